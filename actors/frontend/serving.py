"""From a validated OpenAI request to worker flows: model resolution, tokenization, sampling, and
the per-choice text assembly (detokenization, stop strings, logprobs) — no HTTP here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.engines.protocol import SamplingOptions
from actors.worker.contract import GenerateChunk
from bus.errors import BadRequest, NotFound, Overloaded
from bus.tasks import cancel_and_wait

from .detok import TextStream
from .discovery import ModelEntry, WorkerSet
from .engine_flow import CompletionFlow, FlowDeps, FlowSpec
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


class Choice:
    """One output choice: a flow plus its text stream; turns worker chunks into client deltas."""

    __slots__ = ("index", "flow", "text", "pre", "finish_reason", "stop_reason", "_done")

    def __init__(self, index: int, flow: CompletionFlow, plan: Plan, prompt_ids: list[int] | None) -> None:
        self.index = index
        self.flow = flow
        self.pre = plan.pre
        out = plan.out
        backend = plan.pre.backend if plan.pre is not None else None
        self.text = TextStream(backend, prompt_ids, out.stop, skip_special_tokens=out.skip_special_tokens,
                               include_stop_str_in_output=out.include_stop_str_in_output)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._done = False

    def feed(self, chunk: GenerateChunk) -> str:
        """Delta text for a chunk; sets finish_reason when the choice is complete."""
        ts = self.text
        if self.pre is not None and chunk.token_ids and not chunk.text:
            delta = ts.add_tokens(chunk.token_ids)
        else:
            delta = ts.add_text(chunk.text or "")
        if ts.stop_hit is not None:
            self.finish_reason, self.stop_reason = "stop", ts.stop_hit
        elif chunk.finish_reason is not None:
            self.finish_reason = "stop" if chunk.finish_reason == "stop" else chunk.finish_reason
            self.stop_reason = chunk.stop_reason
            delta += ts.flush()
        return delta


def build_choices(plan: Plan, deps: FlowDeps, *, target: str | None, allow_decode_only: bool,
                  migration_limit: int, on_migrate: Callable[[], None] | None = None,
                  on_quarantine: Callable[[], None] | None = None, migration_wait: float = 60.0) -> list[Choice]:
    choices = []
    idx = 0
    for p, (ids, text) in enumerate(plan.prompts):
        base = plan.sampling[p]
        for j in range(plan.n):
            so = base
            if plan.n > 1 and base.seed is not None:
                so = msgspec.structs.replace(base, seed=base.seed + j)
            spec = FlowSpec(model=plan.entry, request_id=f"{plan.request_id}-{idx}", sampling=so,
                            token_ids=ids, prompt=text, lora=plan.lora, target=target,
                            allow_decode_only=allow_decode_only, migration_limit=migration_limit,
                            migration_wait=migration_wait)
            choices.append(Choice(idx, CompletionFlow(spec, deps, on_migrate, on_quarantine), plan, ids))
            idx += 1
    return choices


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, GenerateChunk]]:
    """All choices' chunks in arrival order. One choice: no tasks, no queue (the hot path)."""
    if len(choices) == 1:
        c = choices[0]
        gen = c.flow.chunks()
        try:
            async for chunk in gen:
                yield c, chunk
                if c.finish_reason is not None:
                    return
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue[tuple[Choice, GenerateChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(c: Choice) -> None:
        gen = c.flow.chunks()
        try:
            async for chunk in gen:
                await queue.put((c, chunk, None))
                if c.finish_reason is not None:
                    break
        except Exception as e:
            await queue.put((c, None, e))
            return
        finally:
            await gen.aclose()
        await queue.put((c, None, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(tasks)
        while left:
            c, chunk, err = await queue.get()
            if err is not None:
                raise err
            if chunk is None:
                left -= 1
                continue
            yield c, chunk
    finally:
        await cancel_and_wait(tasks)
