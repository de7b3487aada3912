"""Validation of a GenerateRequest before it reaches the engine (pure functions, no NATS).

Every failure is a typed ActorError (BadRequest 400, NotFound 404) so the caller gets a clear
message and the engine never sees a request it would choke on.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from actors.engines.limits import LimitError, Limits, check_prompt_ids, check_sampling_limits
from actors.engines.prompt_embeds import EmbedsTooLarge, decode_embeds
from actors.engines.protocol import (
    EmbedsPrompt,
    ModelFacts,
    MultiModalInput,
    Prompt,
    SamplingOptions,
    TextPrompt,
    TokensPrompt,
)
from actors.worker.contract import EmbedRequest, EncodeRequest, GenerateRequest
from bus.errors import BadRequest, PayloadTooLarge


def context_length_message(max_len: int, prompt_tokens: int, max_tokens: int) -> str:
    """vLLM's wording, so OpenAI clients see the message they already know."""
    return (f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.")


def check_context(max_len: int, prompt_tokens: int, max_tokens: int) -> None:
    if prompt_tokens + max_tokens > max_len:
        raise BadRequest(context_length_message(max_len, prompt_tokens, max_tokens))


def check_sampling(s: SamplingOptions, facts: ModelFacts) -> None:
    """The request's own consistency, then the model's limits (the same checks as the frontend's,
    for clients that talk to a worker over NATS)."""
    if s.max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {s.max_tokens}")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise BadRequest(f"temperature must be a finite non-negative number, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {s.top_p}")
    if not 0 <= s.min_p <= 1:
        raise BadRequest(f"min_p must be in [0, 1], got {s.min_p}")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(s, name)):
            raise BadRequest(f"{name} must be a finite number, got {getattr(s, name)}")
    try:  # min_tokens, logprobs, token ids, seed, stop strings: the engine's own rules
        check_sampling_limits(s, Limits.of(facts))
    except LimitError as e:
        raise BadRequest(str(e), param=e.param) from None


def decode_prompt_embeds(data: str, hidden_size: int | None, max_rows: int | None = None) -> Any:
    """The frontend's rule (``actors.engines.prompt_embeds``), for clients that talk to a worker
    over NATS: base64 of a ``torch.save``'d (num_tokens, hidden) tensor → the tensor."""
    try:
        return decode_embeds(data, hidden_size=hidden_size, max_rows=max_rows)
    except EmbedsTooLarge as e:
        raise PayloadTooLarge(str(e), param=e.param) from None
    except LimitError as e:
        raise BadRequest(str(e), param=e.param) from None


def build_prompt(req: GenerateRequest, facts: ModelFacts, embeds_enabled: bool) -> tuple[Prompt, int | None]:
    """The engine prompt and its token count (None when unknown before tokenization: text mode)."""
    given = [name for name in ("token_ids", "prompt", "prompt_embeds") if getattr(req, name) is not None]
    if len(given) != 1:
        raise BadRequest("give exactly one of token_ids, prompt, prompt_embeds"
                         + (f" (got {', '.join(given)})" if given else ""))
    if req.token_ids is not None:
        if not req.token_ids:
            raise BadRequest("token_ids is empty")
        _check_ids(req.token_ids, facts)
        mm = check_mm(req.mm, len(req.token_ids), facts) if req.mm is not None else None
        return TokensPrompt(token_ids=list(req.token_ids), mm=mm), len(req.token_ids)
    if req.mm is not None:
        raise BadRequest("images (mm) go with a token_ids prompt", param="mm")
    if req.prompt is not None:
        if not req.prompt:
            raise BadRequest("prompt is empty")
        return TextPrompt(text=req.prompt), None
    if not embeds_enabled:
        raise BadRequest("prompt_embeds is not enabled for this pool (set prompt_embeds = true)",
                         param="prompt_embeds")
    tensor = decode_prompt_embeds(req.prompt_embeds or "", facts.hidden_size, facts.max_model_len)
    n = int(tensor.shape[0])
    return EmbedsPrompt(tensor=tensor, num_tokens=n), n


def _check_ids(token_ids: list[int], facts: ModelFacts) -> None:
    try:
        check_prompt_ids(token_ids, Limits.of(facts), "token_ids")
    except LimitError as e:
        raise BadRequest(str(e), param=e.param) from None


def check_encode(req: EncodeRequest, facts: ModelFacts, max_model_len: int) -> None:
    """An encode request as its generate request will be checked: the images (``check_mm``) and
    the expanded prompt they lie in (the model's tokens, within its context)."""
    _check_ids(req.token_ids, facts)
    check_mm(req.mm, len(req.token_ids), facts)
    check_context(max_model_len, len(req.token_ids), 1)


def check_embed(req: EmbedRequest, facts: ModelFacts, max_model_len: int) -> None:
    """An embedding request as vLLM's renderer checks a pooling prompt: the model's tokens, not
    empty, and within the context whole (a pooling request has no output tokens)."""
    if not req.token_ids:
        raise BadRequest("the prompt is empty: an embedding needs at least one token", param="input")
    _check_ids(req.token_ids, facts)
    if len(req.token_ids) > max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"prompt contains {len(req.token_ids)} input tokens, which exceeds this limit "
                         "even without any output tokens. Please reduce the length of the input prompt.",
                         param="input_tokens")


def role_sampling(role: str, sampling: SamplingOptions) -> SamplingOptions:
    """Prefill workers compute the prompt's KV and one token; the decode worker does the rest."""
    if role == "prefill":
        return msgspec.structs.replace(sampling, max_tokens=1, min_tokens=0)
    return sampling


def kv_params_for(role: str, req: GenerateRequest) -> dict[str, Any] | None:
    """Decode: merge the prefill's kv_transfer_params (then any raw override on top)."""
    params: dict[str, Any] = {}
    if role == "decode" and req.prefill_result and req.prefill_result.kv_transfer_params:
        params.update(req.prefill_result.kv_transfer_params)
    if req.kv_transfer_params:
        params.update(req.kv_transfer_params)
    return params or None


_UUID_HEX = frozenset("0123456789abcdef")


def check_mm(mm: MultiModalInput, n_tokens: int, facts: ModelFacts) -> MultiModalInput:
    """A token prompt's images, checked before they reach the engine: the model takes images, each
    image's id is a content hash (it names a file in E/P/D's encoder-output hand-off: never a path),
    and the placeholder ranges lie in the prompt."""
    if "image" not in facts.input_modalities:
        raise BadRequest(f"model {facts.served_model_name} does not take images", param="messages")
    if not mm.images or len(mm.placeholders) != len(mm.images):
        raise BadRequest("mm needs one placeholder range per image", param="mm")
    for img in mm.images:
        if len(img.uuid) != 64 or not set(img.uuid) <= _UUID_HEX:
            raise BadRequest("an image uuid is the sha256 hex of its data", param="mm")
    if not mm.source_ids or not 0 < mm.prompt_len <= n_tokens:
        raise BadRequest("mm.source_ids must be given and mm.prompt_len lie within token_ids", param="mm")
    for offset, length in mm.placeholders:
        if offset < 0 or length <= 0 or offset + length > mm.prompt_len:
            raise BadRequest("an image placeholder range lies outside the prompt", param="mm")
    return mm
