"""A planned request's choices: one CompletionFlow per (prompt, n), each with its text stream
(detokenization, stop strings), and all their chunks merged in arrival order. No HTTP here.

Each choice is one engine request of the planner's observations (``observations``): its chunks
are noted as they arrive from its flow, whether the client streams or not."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from actors.worker.contract import GenerateChunk
from bus.tasks import cancel_and_wait
from config.topology import MIGRATION_WAIT

from .completion_flow import CompletionFlow, FlowDeps, FlowSpec
from .detok import TextStream
from .observations import RequestObservation
from .output_parsing import ChoiceParsing
from .planning import Plan

Arrival = tuple["Choice", GenerateChunk]
# what a flow's pump queues: a chunk, or its end (no chunk, no error), or its error
Queued = tuple["Choice", GenerateChunk | None, BaseException | None]


class Choice:
    """One output choice: a flow plus its text stream; turns worker chunks into client deltas."""

    __slots__ = ("index", "flow", "text", "pre", "finish_reason", "stop_reason", "obs", "parsing")

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
        self.obs: RequestObservation | None = None  # set by the pipeline: the planner's view
        # tool calls / reasoning split out of the text (one stateful parser per choice)
        self.parsing: ChoiceParsing | None = plan.parsing.choice() if plan.parsing is not None else None

    def arrived(self, chunk: GenerateChunk) -> None:
        """Note a chunk from the flow as it arrives (before the client is written to)."""
        if self.obs is not None:
            if self.finish_reason is None:  # past a stop string the client sees nothing more
                self.obs.token(time.perf_counter(), len(chunk.token_ids))
            if chunk.finish_reason is not None or self.finish_reason is not None:
                self.ended()

    def ended(self) -> None:
        """The choice is complete (its last chunk, or a stop string): its token counts are final."""
        if self.obs is not None:
            st = self.flow.state
            self.obs.finish(st.prompt_tokens, st.completion_tokens, st.cached_tokens)

    def failed(self) -> None:
        if self.obs is not None:
            self.obs.fail()

    def feed(self, chunk: GenerateChunk) -> str:
        """Delta text for a chunk; sets finish_reason when the choice is complete."""
        ts = self.text
        if self.pre is not None and chunk.token_ids and not chunk.text:
            # a token-mode worker's "stop" is a stop token (stop strings are the frontend's)
            delta = ts.add_tokens(chunk.token_ids, stop_terminated=chunk.finish_reason == "stop")
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
                  session: str | None = None,
                  migration_limit: int, on_migrate: Callable[[], None] | None = None,
                  on_quarantine: Callable[[], None] | None = None, migration_wait: float = MIGRATION_WAIT,
                  trace: Any = None) -> list[Choice]:
    """One flow per prompt and ``n``; ``trace``: the request's span context, when it is traced."""
    choices = []
    idx = 0
    for p, (ids, text) in enumerate(plan.prompts):
        base = plan.sampling[p]
        for j in range(plan.n):
            so = base
            if plan.n > 1 and base.seed is not None:
                so = msgspec.structs.replace(base, seed=base.seed + j)
            spec = FlowSpec(model=plan.entry, request_id=f"{plan.request_id}-{idx}", sampling=so,
                            token_ids=ids, prompt=text, prompt_embeds=plan.prompt_embeds(p),
                            chat=plan.chat_prompt, mm=plan.mm, lora=plan.lora, target=target,
                            session=session if plan.n == 1 and len(plan.prompts) == 1 else None,
                            allow_decode_only=allow_decode_only, migration_limit=migration_limit,
                            migration_wait=migration_wait, trace=trace)
            choices.append(Choice(idx, CompletionFlow(spec, deps, on_migrate, on_quarantine), plan, ids))
            idx += 1
    return choices


@contextlib.asynccontextmanager
async def merged(choices: list[Choice]) -> AsyncIterator[AsyncIterator[Arrival]]:
    """All choices' chunks in arrival order, for the length of the ``async with``: leaving it
    (finished, failed, or the client gone) closes every flow, which cancels its worker stream.

    The flows run as plain tasks stopped by ``cancel_and_wait``, not in an ``asyncio.TaskGroup``: a
    flow's liveness probe is a NATS request, which can swallow a cancel on Python 3.11 (see
    ``bus.tasks``), and a TaskGroup would then wait for it forever; a TaskGroup would also wrap the
    caller's own errors in an ExceptionGroup and drop chunks that arrived before a sibling failed.
    """
    if len(choices) == 1:  # the hot path: no tasks, no queue
        one = _single(choices[0])
        try:
            yield one
        finally:
            await one.aclose()
        return
    queue: asyncio.Queue[Queued] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(c, queue)) for c in choices]
    try:
        yield _arrivals(queue, len(tasks))
    finally:
        await cancel_and_wait(tasks)


async def _single(c: Choice) -> AsyncIterator[Arrival]:
    gen = c.flow.chunks()
    try:
        async for chunk in gen:
            c.arrived(chunk)
            yield c, chunk
            if c.finish_reason is not None:
                break
        c.ended()
    except Exception:
        c.failed()
        raise
    finally:
        await gen.aclose()


async def _pump(c: Choice, queue: asyncio.Queue[Queued]) -> None:
    """One flow's chunks into the shared queue, then its end (None) or its error, in order."""
    gen = c.flow.chunks()
    try:
        async for chunk in gen:
            c.arrived(chunk)
            await queue.put((c, chunk, None))
            if c.finish_reason is not None:
                break
    except Exception as e:
        c.failed()
        await queue.put((c, None, e))
        return
    finally:
        if c.finish_reason is not None:  # a stop string ended it while the flow still ran
            c.ended()
        await gen.aclose()
    c.ended()
    await queue.put((c, None, None))


async def _arrivals(queue: asyncio.Queue[Queued], flows: int) -> AsyncIterator[Arrival]:
    """The queue's chunks until every flow has ended; the first flow error is raised."""
    while flows:
        c, chunk, err = await queue.get()
        if err is not None:
            raise err
        if chunk is None:
            flows -= 1
            continue
        yield c, chunk
