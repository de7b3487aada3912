"""One generation request, top to bottom: parse (openai_io) → plan (planning: model, tokenizer,
limits, max_tokens) → flows (choices, completion_flow: routing, migration, disaggregation) →
respond (responses: one builder for the SSE stream and the JSON body), with its metrics.

A streamed response's headers are sent only once the first chunk has arrived from the worker, so
they can name it, and so errors that happen before any output still get a proper HTTP status. A
client that disconnects cancels the handler task (``handler_cancellation``), which leaves
``merged``, which closes the worker streams, which publish the cancel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from bus import tracing
from bus.errors import ActorError, Overloaded
from config.topology import MIGRATION_WAIT, FrontendConfig, ModelConfig

from . import request_trace
from .api_shape import ApiShape
from .choices import Arrival, Choice, build_choices, merged
from .cold import ColdGate, held_model
from .completion_flow import FlowDeps
from .discovery import WorkerSet
from .http_guard import read_body
from .media import has_media, load_images, malformed_allow_urls, media_session
from .metrics import FrontendMetrics, ModelSeries
from .mm_processor import SHARED as MM_PROCESSORS
from .mm_processor import MmProcessor
from .openai_io import check_request_template, encode_json, error_body, parse_chat, parse_completion
from .output_parsing import ModelParsers
from .planning import NotReady, Plan, check_takes_images, plan_request, resolve
from .preprocess import ModelPreprocessors, Preprocessor
from .quarantine import Quarantine
from .responses import SESSION_HEADER, SSE_DONE, WORKER_HEADER, ResponseBuilder
from .routing import Router
from .worker_link import WorkerLink

log = logging.getLogger(__name__)


class CompletionPipeline:
    """Serves /v1/chat/completions and /v1/completions."""

    def __init__(self, *, workers: WorkerSet, router: Router, link: WorkerLink, config: FrontendConfig,
                 metrics: FrontendMetrics, model_config: ModelConfig | None = None) -> None:
        self.workers = workers
        self.config = config
        self.deps = FlowDeps(workers, router, link, Quarantine(config.quarantine_ttl))
        self.metrics = metrics
        self.model_config = model_config
        # the topology's models answer 503 while no worker serves them, instead of 404
        self.expected = frozenset([model_config.name]) if model_config is not None else frozenset()
        self.preprocessors = ModelPreprocessors(workers, model_config)
        self._parsers: dict[tuple[int, str | None, str | None], ModelParsers] = {}
        self._http: aiohttp.ClientSession | None = None  # image URL fetches (made on first use)
        self.cold: ColdGate | None = None  # holds requests for a cold model (the frontend actor sets it)
        for entry in malformed_allow_urls(config.media):
            log.warning("frontend.media.allow_urls entry %r admits no URL (a host, host:port or an "
                        "http(s) URL prefix)", entry)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _fetcher(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = media_session()
        return self._http

    async def serve(self, request: web.Request, chat: bool, shape: ApiShape | None = None) -> web.StreamResponse:
        """One request of /v1/chat/completions (``chat``), /v1/completions, or of another API that
        ``shape`` translates to a chat completion and back (/v1/responses, /v1/messages)."""
        t0 = time.perf_counter()
        m = self.metrics
        endpoint = shape.endpoint if shape is not None else "chat" if chat else "completions"
        body = await read_body(request, self.config.body_timeout, self.config.max_body_bytes, m)
        series: ModelSeries | None = None  # the model's series, once the request names one that exists
        status = 500
        early: _EarlyStream | None = None  # a stream held for a cold model: its keep-alives
        t_obs = t0  # when the planner's TTFT starts: after a hold (a wake's wait is not engine load)
        span = request_trace.http(request, endpoint)  # None: tracing is off
        plan_span = request_trace.child(span, "plan")
        try:
            if shape is not None:
                # the chat request the shape made is already validated; the raw body is the other
                # API's, which planning must not read as a chat's
                req = await shape.chat_request(body)
                body = b""
            else:
                req = parse_chat(body) if chat else parse_completion(body)
            if chat:
                check_request_template(req.chat_template, self.config.trust_request_chat_template)
            try:
                entry, lora, name = resolve(self.workers, req.model, self.expected)
            except NotReady:
                early = _EarlyStream(request) if req.stream else None
                if not await self._hold(req.model, early):
                    raise
                t_obs = time.perf_counter()
                entry, lora, name = resolve(self.workers, req.model, self.expected)
            series = m.model(entry.name)
            series.queued.inc()
            try:
                pre = await self.preprocessors.get(entry)
                parsers = self._model_parsers(entry.name, pre) if chat else None
                if chat and has_media(req.messages):
                    plan = await self._plan_with_images(req, entry, lora, name, pre, body, parsers)
                else:
                    plan = plan_request(req, entry, lora, name, pre, body, parsers)
            finally:
                series.queued.dec()
            tracing.end(plan_span)
            plan_span = None
            choices = self._choices(plan, target=request.headers.get(WORKER_HEADER),
                                    session=request.headers.get(SESSION_HEADER),
                                    trace=tracing.context_of(span))
            for c in choices:  # each choice is one engine request the planner sees
                c.obs = m.observations.start(t_obs)
            for ids, _ in plan.prompts:
                if ids is not None:
                    series.input_tokens.observe(len(ids))
            out = ResponseBuilder(plan, choices)
            series.inflight.inc()
            try:
                resp = await (self._stream(request, out, t0, shape, early) if plan.stream
                              else self._complete(out, t0, shape))
            finally:
                series.inflight.dec()
            status = resp.status
            for c in choices:
                series.output_tokens.observe(c.flow.state.completion_tokens)
                if c.flow.state.cached_tokens:
                    series.cached_tokens.inc(c.flow.state.cached_tokens)
            pool = self.workers.pool_of(choices[0].flow.state.worker_instance)
            series.pool(pool).duration.observe(time.perf_counter() - t0)
            return resp
        except ActorError as e:
            status = e.code
            if early is not None and early.started:
                # a held stream already answered 200 (its keep-alive comments): the error is an event
                log.warning("held stream failed after its keep-alives: %s", e)
                return await early.fail(e, shape)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499
            label = series.name if series is not None else "unknown"
            m.disconnects.labels(label).inc()
            m.cancellations.labels(label).inc()
            log.info("client disconnected from %s request; worker request cancelled", endpoint)
            raise
        finally:
            m.request_done(endpoint, series.name if series is not None else "unknown", status)
            if span is not None:
                tracing.end(plan_span)  # a request refused while being planned
                request_trace.http_done(span, status, series.name if series is not None else None)

    async def _hold(self, model: str | None, early: _EarlyStream | None) -> bool:
        """Hold a request for a cold model until it serves (``cold.ColdGate``); False when the model
        is not cold (the caller answers as it would have)."""
        name = held_model(model, self.expected)
        if self.cold is None or name is None:
            return False
        return await self.cold.hold(name, early.keepalive if early is not None else None)

    async def _plan_with_images(self, req: Any, entry: Any, lora: str | None, name: str,
                                pre: Preprocessor | None, body: bytes, parsers: ModelParsers | None) -> Plan:
        """A chat that may hold images: they are loaded and checked (data URLs, allowed http(s)
        URLs), then the plan, whose processor run (resizing, tiling) stays off the event loop."""
        messages, images = await load_images(list(req.messages), self.config.media, self._fetcher(),
                                             takes_images=lambda: check_takes_images(entry, pre))
        if not images:
            return plan_request(req, entry, lora, name, pre, body, parsers, messages=messages)
        proc = await self._mm_processor(entry)
        return await asyncio.to_thread(plan_request, req, entry, lora, name, pre, body, parsers,
                                       images=images, messages=messages, mm_proc=proc)

    async def _mm_processor(self, entry: Any) -> MmProcessor:
        """vLLM's processor for the model's files: the topology's path on this host, else the card's."""
        key = (self.preprocessors.model_path(entry), entry.card.context_length)
        proc = MM_PROCESSORS.peek(key)
        if proc is not None:
            return proc
        path = key[0]
        try:
            return await asyncio.to_thread(MM_PROCESSORS.get, key)
        except Exception as e:  # noqa: BLE001 - the model's files are not readable here: say so
            log.warning("no multimodal processor for %s: %s", path, e)
            raise Overloaded(f"model {entry.name}: this frontend cannot load its image processor ({e})") from None

    def _model_parsers(self, model: str, pre: Preprocessor | None) -> ModelParsers | None:
        """The model's tool-call/reasoning parsers over its tokenizer, built once (the topology
        names them; a model it does not name still gets forced tool calls, which need none)."""
        if pre is None:
            return None
        mc = self.model_config if self.model_config and self.model_config.name == model else None
        tool, reasoning = (mc.tool_call_parser, mc.reasoning_parser) if mc is not None else (None, None)
        key = (id(pre), tool, reasoning)  # preprocessors live for the process (preprocess.SHARED)
        parsers = self._parsers.get(key)
        if parsers is None:
            parsers = self._parsers[key] = ModelParsers(tool, reasoning, pre.hf)
        return parsers

    def _choices(self, plan: Plan, target: str | None, session: str | None = None, trace: Any = None) -> list[Choice]:
        """The plan's flows, under the topology's migration settings for its model (the card's
        when this frontend's topology does not name the model)."""
        entry = plan.entry
        series = self.metrics.model(entry.name)
        mc = self.model_config if self.model_config and self.model_config.name == entry.name else None
        return build_choices(
            plan, self.deps, target=target, session=session,
            allow_decode_only=mc.allow_decode_only if mc is not None else True,
            migration_limit=mc.migration_limit if mc is not None else entry.card.migration_limit,
            on_migrate=series.migrations.inc,
            on_quarantine=series.quarantined.inc,
            migration_wait=mc.migration_wait if mc is not None else MIGRATION_WAIT, trace=trace)

    def _pool_of(self, arrival: Arrival | None) -> str | None:
        """The pool of the worker that produced an arrival (agg, or decode): a latency label."""
        return self.workers.pool_of(arrival[0].flow.state.worker_instance) if arrival is not None else None

    async def _frames(self, out: ResponseBuilder, first: Arrival | None, arrivals: AsyncIterator[Arrival],
                      t_first: float) -> AsyncIterator[tuple[list[bytes], bool]]:
        """The response's chat SSE frames from its first arrival on, in batches of the frames ready
        at one moment (the role frame with the first token, the last token with the closing frames),
        each with whether it is the last. A failure after the first arrival is raised from here."""
        # the pool is known from the first arrival on; resolved once here, never per token
        itl = self.metrics.model(out.plan.entry.name).pool(self._pool_of(first)).itl
        pending: list[bytes] = list(out.sse_start())
        item: Arrival | None = first
        last = t_first
        while item is not None:
            c, chunk = item
            delta = out.feed(c, chunk)
            if delta is not None:
                frame = out.sse_piece(c, chunk, delta)
                if frame is not None:
                    pending.append(frame)
                t = time.perf_counter()
                if item is not first and chunk.token_ids:
                    itl.observe((t - last) / len(chunk.token_ids))
                last = t
            if pending and not all(ch.finish_reason is not None for ch in out.choices):
                # a choice still runs: what is ready goes now, never waiting for more
                yield pending, False
                pending = []
            try:
                item = await anext(arrivals, None)
            except ActorError:
                if pending:  # held back while every choice had finished: it still goes before the failure
                    yield pending, False
                raise
        pending.extend(out.sse_end())
        yield pending, True

    async def _stream(self, request: web.Request, out: ResponseBuilder, t0: float,
                      shape: ApiShape | None, early: _EarlyStream | None = None) -> web.StreamResponse:
        async with merged(out.choices) as arrivals:
            first = await anext(arrivals, None)  # errors before any output get a real HTTP status
            t_first = time.perf_counter()
            self.metrics.model(out.plan.entry.name).pool(self._pool_of(first)).ttft.observe(t_first - t0)
            if early is not None and early.started:
                resp = early.response  # held for a cold model: its headers went with the keep-alives
            else:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache", **out.headers()})
                await resp.prepare(request)
            batches = self._frames(out, first, arrivals, t_first)
            if shape is not None:
                return await self._shaped(resp, out, batches, shape)
            # SSE frames ready at the same moment leave in one write (one syscall, one chunk); the
            # last batch goes with [DONE] in the final write
            tail: list[bytes] = []
            try:
                async for batch, final in batches:
                    if final:
                        tail = batch
                    else:
                        await resp.write(batch[0] if len(batch) == 1 else b"".join(batch))
            except ActorError as e:
                log.warning("stream %s failed after headers: %s", out.plan.request_id, e)
                tail.append(out.sse_error(e))
        tail.append(SSE_DONE)
        await resp.write_eof(b"".join(tail))
        return resp

    async def _shaped(self, resp: web.StreamResponse, out: ResponseBuilder,
                      batches: AsyncIterator[tuple[list[bytes], bool]], shape: ApiShape) -> web.StreamResponse:
        """Another API's stream over the chat frames: ``shape.events`` reads them one by one (as
        ``data: ...`` strings, ending with [DONE] when the response completed) and writes its own
        events. A failure ends the frames without [DONE]; the shape then says it in its own error
        event, typed as the failure was (vLLM's converters would call it an internal error)."""
        failure: list[ActorError] = []

        async def frames() -> AsyncIterator[str]:
            first = True
            try:
                async for batch, _ in batches:
                    for frame in batch:
                        if first:
                            # the first frame carries the prompt's usage, as vllm serve's continuous
                            # usage does: Anthropic's message_start reports its input tokens
                            first = False
                            frame = frame[:-3] + b',"usage":' + encode_json(out.usage()) + b"}\n\n"
                        yield frame.decode()
            except ActorError as e:
                log.warning("stream %s failed after headers: %s", out.plan.request_id, e)
                failure.append(e)
                return
            yield SSE_DONE.decode()

        async for event in shape.events(out.plan, frames()):
            await resp.write(event)
        if failure:
            await resp.write(shape.error_event(failure[0]))
        await resp.write_eof()
        return resp

    async def _complete(self, out: ResponseBuilder, t0: float, shape: ApiShape | None) -> web.Response:
        async with merged(out.choices) as arrivals:
            first = True
            async for c, chunk in arrivals:
                if first:
                    first = False
                    pool = self.workers.pool_of(c.flow.state.worker_instance)
                    self.metrics.model(out.plan.entry.name).pool(pool).ttft.observe(time.perf_counter() - t0)
                out.feed(c, chunk)
        body = out.body() if shape is None else await shape.body(out.plan, out.body())
        return web.Response(body=encode_json(body), content_type="application/json", headers=out.headers())


class _EarlyStream:
    """A stream held for a cold model: its first keep-alive sends the SSE headers (200), then an
    SSE comment every ``frontend.cold.keepalive`` seconds, which clients skip and proxies see as
    traffic. The response is then the stream's; an error after it is an SSE error event."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.started = False

    async def keepalive(self) -> None:
        if not self.started:
            self.started = True
            await self.response.prepare(self.request)
        await self.response.write(b": waiting for the model to wake up\n\n")

    async def fail(self, err: ActorError, shape: ApiShape | None) -> web.StreamResponse:
        if shape is not None:
            await self.response.write(shape.error_event(err))
            await self.response.write_eof()
        else:
            await self.response.write_eof(b"data: " + error_body(err) + b"\n\n" + SSE_DONE)
        return self.response
