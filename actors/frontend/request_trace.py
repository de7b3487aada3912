"""The spans of one generation request (``bus.tracing``): the HTTP request, its plan, and an
attempt per worker it is sent to, each with the routing decision that chose the worker.

    POST /v1/chat/completions            (pipeline: the HTTP request)
    ├── plan                             (parse, chat template, tokenize, limits)
    ├── prefill   attempt 1              (disaggregation: the prompt on a prefill worker)
    │   ├── route                        (pool, candidates, chosen worker, overlap, predicted cost)
    │   └── worker.generate              (the worker process: its engine actor, then the engine)
    ├── decode    attempt 1              ("generate" on an agg worker)
    │   ├── route
    │   └── worker.generate
    └── decode    attempt 2              (a migration: the rest of the stream on another worker)

Every function takes and returns None when the request is not traced (tracing off), so the
pipeline and the flows call them unguarded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from actors.worker.contract import GenerateChunk
from bus import tracing

from .discovery import Worker
from .worker_link import WorkerStream

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from .routing import Router


def http(request: web.Request, endpoint: str) -> Span | None:
    """The HTTP request's span: under the client's ``traceparent`` when it sent one (then sampled
    as the client's flag says), else the root of a new trace (sampled at ``tracing.sample_ratio``).
    None when tracing is off or the trace is not sampled."""
    if not tracing.enabled():
        return None
    span = tracing.start(f"{request.method} {request.path}", tracing.extract(request.headers), kind="server",
                         attributes={"http.request.method": request.method, "url.path": request.path,
                                     "vllm_actors.endpoint": endpoint})
    # not sampled: nothing under it is recorded either, so nothing is made at all (no plan, attempt
    # or route spans, no traceparent to the worker, which traces only what carries one)
    return span if span is not None and span.is_recording() else None


def http_done(span: Span | None, status: int, model: str | None) -> None:
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    if model is not None:
        span.set_attribute("gen_ai.request.model", model)
    if status >= 500:  # a client's error is not the server's (OpenTelemetry's HTTP server convention)
        tracing.fail(span, f"HTTP {status}")
    span.end()


def child(parent: Span | None, name: str) -> Span | None:
    return tracing.start(name, tracing.context_of(parent)) if parent is not None else None


def attempt(parent: Any, phase: str, number: int, request_id: str) -> Span | None:
    """One send of the request to a worker: ``phase`` "prefill", "decode" or "generate" (agg);
    ``number`` counts from 1 within the phase (2 and on: a migration or a retry)."""
    if parent is None:
        return None
    return tracing.start(phase, parent, kind="client",
                         attributes={"vllm_actors.attempt": number, "vllm_actors.request_id": request_id})


def choose(attempt_span: Span | None, pool: list[Worker], excluded: int, router: Router,
           pick: Callable[[], Worker]) -> Worker:
    """``pick()`` (the router's choice) under a "route" span that records the decision: the
    worker, and with the KV router its cached-prefix overlap and predicted cost. No worker to be
    had (none left, an unknown pinned one) also ends the attempt, failed."""
    if attempt_span is None:
        return pick()
    span = tracing.start("route", tracing.context_of(attempt_span),
                         attributes={"vllm_actors.candidates": len(pool), "vllm_actors.excluded": excluded})
    try:
        worker = pick()
    except BaseException as e:
        tracing.end(span, e)
        tracing.end(attempt_span, e)
        raise
    attrs: dict[str, Any] = {"vllm_actors.worker_id": worker.instance, "vllm_actors.pool": worker.pool,
                             "vllm_actors.router": router.name}
    decision = router.last_decision
    if decision is not None and decision.instance == worker.instance:
        attrs.update({"vllm_actors.overlap_blocks": decision.overlap_blocks,
                      "vllm_actors.request_blocks": decision.request_blocks,
                      "vllm_actors.predicted_cost": decision.cost, "vllm_actors.cost_model": decision.cost_model,
                      "vllm_actors.dp_rank": decision.dp_rank})
    span.set_attributes(attrs)
    span.end()
    attempt_span.set_attributes({"vllm_actors.worker_id": worker.instance, "vllm_actors.pool": worker.pool})
    return worker


def stream(attempt_span: Span | None, call: WorkerStream) -> WorkerStream:
    """``call`` as the attempt's stream: the attempt span ends with it (``TracedStream``); ``call``
    itself when the request is not traced."""
    return call if attempt_span is None else TracedStream(call, attempt_span)


class TracedStream:
    """A worker stream that ends its attempt's span when the flow closes it: failed with what its
    iteration raised, or "ended without a finish reason" when it ran out without one; fine when
    its last chunk finished the request; cancelled when it was closed before either (the client
    went away). It counts the tokens the worker produced in the attempt."""

    def __init__(self, call: WorkerStream, span: Span) -> None:
        self._call, self._span = call, span
        self._chunks = call.__aiter__()
        self._error: BaseException | None = None
        self._finished = self._exhausted = False
        self._tokens = 0
        self._open = True

    @property
    def instance(self) -> str | None:
        return self._call.instance

    def __aiter__(self) -> TracedStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        try:
            chunk: GenerateChunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._exhausted = True
            raise
        except BaseException as e:
            self._error = e
            raise
        self._tokens += len(chunk.token_ids)
        self._finished = self._finished or chunk.finish_reason is not None
        return chunk

    async def aclose(self) -> None:
        try:
            await self._call.aclose()
        finally:
            if self._open:
                self._open = False
                self._end()

    def _end(self) -> None:
        self._span.set_attribute("vllm_actors.tokens", self._tokens)
        if self._error is not None or self._finished:
            tracing.end(self._span, self._error)
        elif self._exhausted:
            tracing.fail(self._span, "the stream ended without a finish reason")
            self._span.end()
        else:
            tracing.end(self._span, asyncio.CancelledError())
