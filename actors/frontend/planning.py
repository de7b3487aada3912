"""Planning one request: from a validated OpenAI request to what its flows need — the model it
names, its prompts as token ids (chat template, tokenizer), max_tokens from the context left, and
the model card's limits. No HTTP, no workers here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.engines.protocol import SamplingOptions
from bus.errors import BadRequest, NotFound, Overloaded

from .discovery import ModelEntry, WorkerSet
from .limits import card_limits, check_fan_out, check_prompt, check_sampling
from .openai_io import OutputOptions, new_id, requested_max_tokens, to_sampling
from .preprocess import Preprocessor


@dataclass
class Plan:
    chat: bool
    model: str  # as the client named it
    entry: ModelEntry
    lora: str | None
    pre: Preprocessor | None
    prompts: list[tuple[list[int] | None, str | None]]  # (token ids, text) per prompt
    n: int
    sampling: list[SamplingOptions]  # per prompt (max_tokens depends on the prompt length)
    out: OutputOptions
    stream: bool
    include_usage: bool
    request_id: str
    echo_texts: list[str] = field(default_factory=list)


class NotReady(Overloaded):
    """The model is part of this deployment but cannot be served right now (starting, restarting,
    asleep): 503 with Retry-After, never a 404."""


def resolve(workers: WorkerSet, name: str | None, expected: frozenset[str] = frozenset()
            ) -> tuple[ModelEntry, str | None, str]:
    """``expected``: models this deployment serves (the topology's), which answer 503 while no
    worker can serve them instead of 404."""
    if not name:
        if len(workers.models) == 1:
            entry = next(iter(workers.models.values()))
            return entry, None, entry.name
        if not workers.models and expected:
            raise NotReady(f"model {', '.join(sorted(expected))} is not ready yet: no worker can serve it now")
        raise BadRequest("model is required")
    found = workers.resolve_model(name)
    if found is None:
        if name in expected or workers.known_model(name):
            raise NotReady(f"model {name} is not ready yet: no worker can serve it now (see /health)")
        raise NotFound(f"The model `{name}` does not exist.", param="model")
    return found[0], found[1], name


def _max_tokens(requested: int | None, prompt_len: int, ctx: int) -> int:
    left = ctx - prompt_len
    if left <= 0:
        raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, your "
                         f"prompt has {prompt_len} tokens.")
    if requested is None:
        return left
    if requested > left:
        raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, you requested "
                         f"{requested + prompt_len} tokens ({prompt_len} in the messages, {requested} in "
                         f"the completion). Please reduce the length of the messages or completion.")
    return requested


def plan_request(req: ChatCompletionRequest | CompletionRequest, entry: ModelEntry, lora: str | None,
                 name: str, pre: Preprocessor | None, body: bytes = b"") -> Plan:
    chat = isinstance(req, ChatCompletionRequest)
    card = entry.card
    ctx = card.context_length
    limits = card_limits(card)
    n = req.n if req.n is not None else 1
    prompts: list[tuple[list[int] | None, str | None]] = []
    if chat:
        check_fan_out(n, 1)
        if pre is None:
            raise Overloaded(f"no tokenizer for model {entry.name} at this frontend (set model.tokenizer "
                             "in the topology); only /v1/completions with text prompts can be served")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = pre.render_chat(list(req.messages), add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               chat_template=req.chat_template, template_kwargs=req.chat_template_kwargs,
                               tools=tools)
        prompts.append((pre.encode(text, req.add_special_tokens), None))
    else:
        if req.prompt_embeds is not None:
            raise BadRequest("prompt_embeds is not supported by this frontend")
        p = req.prompt
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p or [])
        if not items:
            raise BadRequest("prompt must not be empty")
        check_fan_out(n, len(items))
        for item in items:
            if isinstance(item, str):
                if pre is None:
                    prompts.append((None, item))  # text mode: the worker tokenizes
                else:
                    prompts.append((pre.encode(item, req.add_special_tokens), None))
            else:
                if not item:
                    raise BadRequest("prompt must not be empty")
                given = list(item)
                check_prompt(given, limits, chat)  # before anything decodes, hashes or sends them
                prompts.append((given, None))
    requested = requested_max_tokens(req, body)
    samplings: list[SamplingOptions] = []
    out: OutputOptions | None = None
    for ids, _text in prompts:
        plen = len(ids) if ids is not None else 0
        mt = _max_tokens(requested, plen, ctx) if ids is not None else (requested or 16)
        so, out = to_sampling(req, mt, text_mode=ids is None)
        check_sampling(so, out.stop, n, limits, chat)
        samplings.append(so)
    assert out is not None
    stream = bool(req.stream)
    include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)
    echo_texts: list[str] = []
    if out.echo:
        for ids, text in prompts:
            echo_texts.append(text if text is not None else (pre.decode(ids, False) if pre and ids else ""))
    return Plan(chat=chat, model=name, entry=entry, lora=lora, pre=pre, prompts=prompts, n=n,
                sampling=samplings, out=out, stream=stream, include_usage=include_usage,
                request_id=new_id("chatcmpl" if chat else "cmpl"), echo_texts=echo_texts)
