"""A /v1/completions request's ``prompt_embeds``, checked at the frontend before anything is routed.

vLLM's server takes one base64 ``torch.save`` tensor or a list of them, each a prompt of its own,
ahead of any text prompts of the same request. The checks are the worker's own rule
(``actors.engines.prompt_embeds``) against the model card: every live pool of the model must enable
them (a worker of a pool that does not would refuse the request after routing), and the hidden size
is the card's. The client's base64 is forwarded as sent; the worker decodes it again (it also serves
clients that talk to it over NATS).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.engines.limits import LimitError
from actors.engines.prompt_embeds import PARAM, EmbedsTooLarge, decode_embeds
from bus.errors import BadRequest, PayloadTooLarge

from .discovery import ModelEntry


@dataclass(frozen=True, slots=True)
class ClientEmbeds:
    """One embeddings prompt: the client's base64 (sent to the worker as is) and its row count (the
    prompt's tokens, for the context check and usage)."""

    data: str
    rows: int


def _items(given: bytes | list[bytes] | None) -> list[bytes]:
    if given is None:
        return []
    return [given] if isinstance(given, bytes) else list(given)


def check_enabled(entry: ModelEntry) -> None:
    """Every pool a request of this model may reach enables prompt embeddings (its card says so)."""
    off = sorted(card.pool for card in entry.cards.values() if not card.prompt_embeds)
    if off:
        keys = ", ".join(f"pools.{pool}.prompt_embeds = true" for pool in off)
        raise BadRequest(f"prompt_embeds is not enabled for model {entry.name}: set {keys} in the "
                         "topology (vLLM: --enable-prompt-embeds)", param=PARAM)


def client_embeds(req: CompletionRequest, entry: ModelEntry) -> list[ClientEmbeds]:
    """The request's embeddings prompts, each decoded and checked (400 on the first bad one); []
    when it has none."""
    items = _items(req.prompt_embeds)
    if not items:
        return []
    check_enabled(entry)
    if req.echo:
        raise BadRequest("Echo is unsupported with prompt embeds.", param="echo")
    if req.prompt_logprobs is not None:
        raise BadRequest("prompt_logprobs is not compatible with prompt embeds.", param="prompt_logprobs")
    card = entry.card
    hidden = next((c.hidden_size for c in entry.cards.values() if c.hidden_size), None)
    out: list[ClientEmbeds] = []
    for i, item in enumerate(items):
        try:
            tensor = decode_embeds(item, hidden_size=hidden, max_rows=card.context_length)
        except LimitError as e:
            where = f" (prompt_embeds[{i}])" if len(items) > 1 else ""
            kind = PayloadTooLarge if isinstance(e, EmbedsTooLarge) else BadRequest
            raise kind(f"{e}{where}", param=e.param) from None
        # valid base64 is ASCII; the tensor itself is not kept (the worker decodes its own copy)
        out.append(ClientEmbeds(data=item.decode("ascii"), rows=int(tensor.shape[0])))
    return out
