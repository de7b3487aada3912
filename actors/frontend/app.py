"""The HTTP server: aiohttp routes for the OpenAI surface, SSE framing, headers, errors, metrics.

Response headers name the serving worker (``x-worker-instance-id``) and, for disaggregated
requests, the prefill worker (``x-prefill-instance-id``). A streamed response's headers are sent
only once the first chunk has arrived from the worker, so they can name it, and so errors that
happen before any output still get a proper HTTP status. A client that disconnects cancels the
handler task (``handler_cancellation``), which closes the worker stream, which publishes the cancel.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from actors.worker.contract import GenerateChunk
from bus.errors import ActorError, BadRequest, NotFound, PayloadTooLarge
from config import secrets
from config.topology import FrontendConfig, ModelConfig

from .discovery import ModelEntry, WorkerSet
from .engine_flow import FlowDeps, WorkerLink
from .http_guard import read_body
from .metrics import FrontendMetrics
from .openai_io import (
    RETRY_AFTER_S,
    SSE_DONE,
    ChunkFramer,
    chat_logprobs,
    completion_logprobs,
    encode_json,
    error_body,
    now,
    parse_chat,
    parse_completion,
    usage_dict,
)
from .preprocess import SHARED, Preprocessor, PreprocessorCache, resolve_model_path
from .quarantine import Quarantine
from .routing import Router
from .serving import Choice, Plan, build_choices, merged, plan_request, resolve

log = logging.getLogger(__name__)

WORKER_HEADER = "x-worker-instance-id"
PREFILL_HEADER = "x-prefill-instance-id"
_JSON = "application/json"


class Unauthorized(ActorError):
    code = 401
    kind = "authentication_error"


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encode_json(obj), status=status, content_type=_JSON, headers=headers)


def error_response(err: ActorError) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if err.code == 503 else None
    return web.Response(body=error_body(err), status=err.code, content_type=_JSON, headers=headers)


class FrontendApp:
    def __init__(self, *, workers: WorkerSet, router: Router, link: WorkerLink, config: FrontendConfig,
                 health: Callable[..., Awaitable[tuple[bool, dict[str, Any]]]],
                 model_config: ModelConfig | None = None, metrics: FrontendMetrics | None = None,
                 preprocessors: PreprocessorCache | None = None) -> None:
        self.workers = workers
        self._health = health
        self._expected = frozenset([model_config.name]) if model_config is not None else frozenset()
        self.router = router
        self.quarantine = Quarantine(config.quarantine_ttl)
        self.deps = FlowDeps(workers, router, link, self.quarantine)
        self.config = config
        self.model_config = model_config
        self.metrics = metrics or FrontendMetrics()
        self.pre_cache = preprocessors or SHARED
        self._loading: dict[tuple[str, str | None], asyncio.Future[Preprocessor | None]] = {}
        key = secrets.resolve(config.api_key, config.api_key_file, config.api_key_env, "frontend.api_key")
        self._api_key = key.encode() if key else None
        # /health and /live stay open (load balancers, systemd, kubelets probe them without a key)
        self._protected = ("/v1/", "/metrics") if config.metrics_auth else ("/v1/",)
        workers.listeners.append(self._warm_tokenizers)

    # --- app ---------------------------------------------------------------------------------------
    def build(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors_mw])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_handler)
        return app

    @web.middleware
    async def _errors_mw(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if self._api_key is not None and request.path.startswith(self._protected):
                auth = request.headers.get("Authorization", "")
                if not hmac.compare_digest(auth.removeprefix("Bearer ").encode(), self._api_key):
                    raise Unauthorized("invalid or missing API key")
            return await handler(request)
        except ActorError as e:
            return error_response(e)
        except web.HTTPRequestEntityTooLarge:
            return error_response(PayloadTooLarge(
                f"request body exceeds the limit of {self.config.max_body_bytes} bytes"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = ActorError(e.reason or "error", e.status)
            err.kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            resp = error_response(err)
            if "Allow" in e.headers:  # a 405 must say which methods the route has (RFC 9110)
                resp.headers["Allow"] = e.headers["Allow"]
            return resp
        except Exception as e:
            log.exception("internal error on %s", request.path)
            return error_response(ActorError(f"internal error: {type(e).__name__}: {e}"))

    # --- tokenizers -------------------------------------------------------------------------------------
    def _pre_key(self, entry: ModelEntry) -> tuple[str, str | None] | None:
        """(tokenizer dir, template file): the topology's model section wins over the card, since
        it names paths on this host (a mocker's card says "mock"; a remote worker's paths are its own)."""
        card = entry.card
        path, template = card.tokenizer_path, card.chat_template
        mc = self.model_config
        if mc is not None and mc.name == entry.name:
            path = mc.tokenizer or mc.path or path
            template = mc.chat_template or template
        if not path or path == "mock":
            return None
        return resolve_model_path(path), template

    async def _preprocessor(self, entry: ModelEntry) -> Preprocessor | None:
        key = self._pre_key(entry)
        if key is None:
            return None
        pre = self.pre_cache.peek(*key)
        if pre is not None:
            return pre
        fut = self._loading.get(key)
        if fut is None:
            fut = self._loading[key] = asyncio.ensure_future(self._load(key))
        return await asyncio.shield(fut)

    async def _load(self, key: tuple[str, str | None]) -> Preprocessor | None:
        try:
            return await asyncio.to_thread(self.pre_cache.get, *key)
        except Exception as e:  # no usable tokenizer: text mode for completions
            log.warning("cannot load tokenizer %s (%s): text mode only", key[0], e)
            return None

    def _warm_tokenizers(self) -> None:
        """Load a model's tokenizer as soon as its card appears, not on its first request."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for entry in list(self.workers.models.values()):
            key = self._pre_key(entry)
            if key is not None and key not in self._loading and self.pre_cache.peek(*key) is None:
                self._loading[key] = loop.create_task(self._load(key))

    # --- info routes --------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        created = now()
        data = []
        if not (await self._health(detail=False))[0]:
            # /health, /v1/models and READY=1 are three views of one fact: while the deployment is
            # not ready, nothing is listed (a request that can be served is still served)
            return _json({"object": "list", "data": data})
        for name, entry in sorted(self.workers.models.items()):
            data.append({"id": name, "object": "model", "created": created, "owned_by": "vllm-actors",
                         "root": entry.card.model_path, "parent": None,
                         "max_model_len": entry.card.context_length})
        for name, lora in sorted(self.workers.loras.items()):
            base = lora.get("model") or (next(iter(self.workers.models)) if len(self.workers.models) == 1
                                         else None)
            data.append({"id": name, "object": "model", "created": created, "owned_by": "vllm-actors",
                         "root": name, "parent": base})
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 only while the deployment can serve (actors.frontend.readiness)."""
        ready, body = await self._health()
        return _json(body, status=200 if ready else 503, headers=None if ready else {"Retry-After": RETRY_AFTER_S})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"status": "live"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": self.metrics.content_type})

    # --- generation ---------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        m = self.metrics
        endpoint = "chat" if chat else "completions"
        cl = request.content_length
        if cl is not None and cl > self.config.max_body_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {self.config.max_body_bytes} bytes")
        body = await read_body(request, self.config.body_timeout, self.metrics)
        label = "unknown"
        status = 500
        try:
            req = parse_chat(body) if chat else parse_completion(body)
            entry, lora, name = resolve(self.workers, req.model, self._expected)
            label = entry.name
            m.queued.labels(label).inc()
            try:
                pre = await self._preprocessor(entry)
                plan = plan_request(req, entry, lora, name, pre, body)
            finally:
                m.queued.labels(label).dec()
            mc = self.model_config if self.model_config and self.model_config.name == entry.name else None
            migration_limit = mc.migration_limit if mc is not None else entry.card.migration_limit
            choices = build_choices(
                plan, self.deps, target=request.headers.get(WORKER_HEADER),
                allow_decode_only=mc.allow_decode_only if mc is not None else True,
                migration_limit=migration_limit, on_migrate=m.migrations.labels(label).inc,
                on_quarantine=m.quarantined.labels(label).inc,
                migration_wait=mc.migration_wait if mc is not None else 60.0)
            for ids, _ in plan.prompts:
                if ids is not None:
                    m.input_tokens.labels(label).observe(len(ids))
            m.inflight.labels(label).inc()
            try:
                if plan.stream:
                    resp = await self._stream(request, plan, choices, t0)
                else:
                    resp = await self._complete(plan, choices, t0)
            finally:
                m.inflight.labels(label).dec()
            status = resp.status
            st = [c.flow.state for c in choices]
            for s in st:
                m.output_tokens.labels(label).observe(s.completion_tokens)
                if s.cached_tokens:
                    m.cached_tokens.labels(label).inc(s.cached_tokens)
            m.duration.labels(label).observe(time.perf_counter() - t0)
            return resp
        except ActorError as e:
            status = e.code
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499
            m.disconnects.labels(label).inc()
            m.cancellations.labels(label).inc()
            log.info("client disconnected from %s request; worker request cancelled", endpoint)
            raise
        finally:
            m.requests.labels(endpoint, label, str(status)).inc()

    def _headers(self, choices: list[Choice]) -> dict[str, str]:
        workers = list(dict.fromkeys(c.flow.state.worker_instance for c in choices
                                     if c.flow.state.worker_instance))
        prefills = list(dict.fromkeys(c.flow.state.prefill_instance for c in choices
                                      if c.flow.state.prefill_instance))
        h = {}
        if workers:
            h[WORKER_HEADER] = ",".join(workers)
        if prefills:
            h[PREFILL_HEADER] = ",".join(prefills)
        return h

    def _piece(self, plan: Plan, c: Choice, chunk: GenerateChunk, delta: str, offset: int) -> dict[str, Any]:
        lps = None
        if plan.out.logprobs is not None and chunk.logprobs and plan.pre is not None:
            if plan.chat:
                lps = {"content": chat_logprobs(chunk.logprobs, plan.pre.token_str)}
            else:
                lps = completion_logprobs(chunk.logprobs, plan.pre.token_str, offset)
        piece: dict[str, Any] = {"index": c.index}
        if plan.chat:
            piece["delta"] = {"content": delta} if delta or c.finish_reason is None else {}
        else:
            piece["text"] = delta
        piece["logprobs"] = lps
        piece["finish_reason"] = c.finish_reason
        if c.finish_reason is not None:
            piece["stop_reason"] = c.stop_reason
        return piece

    def _usage(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        prompt = cached = completion = 0
        for c in choices:
            st = c.flow.state
            completion += st.completion_tokens
            if c.index % plan.n == 0:  # prompt counted once per prompt, not per n
                prompt += st.prompt_tokens
                cached += st.cached_tokens
        return usage_dict(prompt, completion, cached)

    async def _stream(self, request: web.Request, plan: Plan, choices: list[Choice],
                      t0: float) -> web.StreamResponse:
        m, label = self.metrics, plan.entry.name
        it = merged(choices)
        try:
            first = await it.__anext__()  # errors before any output get a real HTTP status
        except StopAsyncIteration:
            first = None
        except BaseException:
            await it.aclose()
            raise
        t_first = time.perf_counter()
        m.ttft.labels(label).observe(t_first - t0)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._headers(choices)}
        resp = web.StreamResponse(headers=headers)
        framer = ChunkFramer(plan.request_id, "chat.completion.chunk" if plan.chat else "text_completion",
                             now(), plan.model)
        offsets = [0] * len(choices)
        echoed: set[int] = set()
        try:
            await resp.prepare(request)
            if plan.chat:
                await resp.write(framer.choices([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None} for c in choices]))
            item, last = first, t_first
            while item is not None:
                c, chunk = item
                if c.finish_reason is None:
                    delta = c.feed(chunk)
                    if plan.out.echo and c.index not in echoed:
                        echoed.add(c.index)
                        delta = plan.echo_texts[c.index // plan.n] + delta
                    if delta or c.finish_reason is not None or (chunk.logprobs and plan.out.logprobs is not None):
                        await resp.write(framer.choices([self._piece(plan, c, chunk, delta, offsets[c.index])]))
                        offsets[c.index] += len(delta)
                    t = time.perf_counter()
                    if item is not first and chunk.token_ids:
                        m.itl.labels(label).observe((t - last) / len(chunk.token_ids))
                    last = t
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    item = None
            for c in choices:  # a stream that ended without finish (should not happen): close it
                if c.finish_reason is None:
                    c.finish_reason = c.flow.state.finish_reason or "stop"
                    await resp.write(framer.choices([{"index": c.index, **({"delta": {"content": c.text.flush()}}
                                     if plan.chat else {"text": c.text.flush()}), "logprobs": None,
                                     "finish_reason": c.finish_reason}]))
            if plan.include_usage:
                await resp.write(framer.usage(self._usage(plan, choices)))
        except ActorError as e:
            log.warning("stream %s failed after headers: %s", plan.request_id, e)
            await resp.write(framer.error(e))
        finally:
            await it.aclose()
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    async def _complete(self, plan: Plan, choices: list[Choice], t0: float) -> web.Response:
        texts: list[list[str]] = [[] for _ in choices]
        lps: list[list[Any]] = [[] for _ in choices]
        it = merged(choices)
        first = True
        try:
            async for c, chunk in it:
                if first:
                    first = False
                    self.metrics.ttft.labels(plan.entry.name).observe(time.perf_counter() - t0)
                if c.finish_reason is not None:
                    continue
                texts[c.index].append(c.feed(chunk))
                if chunk.logprobs and plan.out.logprobs is not None:
                    lps[c.index].extend(chunk.logprobs)
        finally:
            await it.aclose()
        out = []
        for c in choices:
            text = "".join(texts[c.index]) + c.text.flush()
            if c.finish_reason is None:
                c.finish_reason = c.flow.state.finish_reason or "stop"
            lp = None
            if plan.out.logprobs is not None and plan.pre is not None:
                lp = ({"content": chat_logprobs(lps[c.index], plan.pre.token_str)} if plan.chat
                      else completion_logprobs(lps[c.index], plan.pre.token_str, 0))
            if plan.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            else:
                if plan.out.echo:
                    text = plan.echo_texts[c.index // plan.n] + text
                out.append({"index": c.index, "text": text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        body = {"id": plan.request_id, "object": "chat.completion" if plan.chat else "text_completion",
                "created": now(), "model": plan.model, "choices": out, "usage": self._usage(plan, choices)}
        return _json(body, headers=self._headers(choices))


__all__ = ["FrontendApp", "WORKER_HEADER", "PREFILL_HEADER", "BadRequest", "NotFound"]
