"""POST /v1/embeddings: vLLM's request model, the frontend's tokenizer, one worker request per input
(a text, a token-id list, or a chat rendered with the model's chat template).

The request is validated with vLLM's own ``EmbeddingRequest`` (so fields and 400s match
``vllm serve``); ``dimensions`` is checked with vLLM's ``PoolingParams.verify`` and the inputs are
tokenized, truncated (``truncate_prompt_tokens``, ``truncation_side``) and length-checked with
vLLM's ``TokenizeParams`` against the model card's facts (``embedding_io``: request and response). Each
input is then one ``EmbedRequest`` to an embedding worker (``ns.worker.<id>.embed``, unary):
inputs are fanned out over the pool's workers, each to the one with the fewest embeddings this
frontend has in flight on it (no KV routing: a prompt is pooled in one step and nothing of it is
kept), and gathered in input order. An embedding is idempotent, so an input whose worker died,
refused or went silent is sent to another one (``migration_limit``), with the chat pipeline's
liveness question, wait for a worker and quarantine. A client that leaves cancels the inputs'
requests, and each worker still running one is told to abort it.

The response is vLLM's shape (``EmbeddingResponse``): ``float`` lists, or ``base64`` of the
embedding's bytes in ``embed_dtype`` and ``endianness`` (vLLM's ``tensor2binary``); ``bytes`` and
``bytes_only`` are those bytes back to back as the body (``bytes``: a ``metadata`` header says where
each one is). Workers send little-endian float32 bytes, which already are the default payload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from actors.engines.protocol import SamplingOptions
from actors.worker.contract import EmbedReply, EmbedRequest, EngineDead
from bus.errors import ActorError, BadRequest, NotFound, Overloaded, RequestTimeout, Unavailable
from config.topology import MIGRATION_WAIT, FrontendConfig, ModelConfig

from . import request_trace
from .cold import ColdGate, held_model
from .completion_flow import MIGRATABLE, BusUnavailable, MigrationExhausted
from .discovery import ModelEntry, Worker, WorkerSet
from .embedding_io import EmbedPlan, binary_response, parse_embedding, plan_embedding, shape_response
from .http_guard import read_body
from .metrics import FrontendMetrics
from .openai_io import encode_json
from .planning import NotReady, resolve
from .preprocess import ModelPreprocessors
from .quarantine import DEATHS_TO_QUARANTINE, Quarantine, fingerprint
from .responses import WORKER_HEADER
from .worker_link import Liveness

log = logging.getLogger(__name__)

PATH = "/v1/embeddings"
ENDPOINT = "embeddings"  # the metrics' endpoint label
# inputs of one request in flight at once: a 2048-input batch must not take every worker slot
# from the other clients' requests (the workers' own semaphores bound the rest)
MAX_PARALLEL_INPUTS = 64
# a body this large is tokenized off the event loop (other requests' chunks keep flowing)
_INLINE_BODY = 64 << 10
# what the fingerprint of an embedding input holds besides its ids: never a sampling (a constant)
_NO_SAMPLING = SamplingOptions(max_tokens=0)


class EmbedLink(Protocol):
    """The bus side (``actors.frontend.client.WorkerClient``)."""

    async def embed(self, worker: Worker, req: EmbedRequest) -> EmbedReply: ...

    async def cancel(self, worker: Worker, request_id: str) -> None: ...

    async def connected(self) -> bool: ...

    async def liveness(self, worker: Worker) -> Liveness: ...


@dataclass
class _Input:
    """One input's attempts: the workers that failed it, and the deaths it coincided with."""

    index: int
    ids: list[int]
    failed: dict[str, float] = field(default_factory=dict)  # instance -> its started_at when it failed
    gone: set[str] = field(default_factory=set)  # failed workers that died (their supervisor restarts them)
    deaths: list[str] = field(default_factory=list)
    worker: str | None = None  # the instance that answered


class EmbeddingService:
    """Serves /v1/embeddings for one frontend process."""

    def __init__(self, *, workers: WorkerSet, link: EmbedLink, config: FrontendConfig, metrics: FrontendMetrics,
                 preprocessors: ModelPreprocessors, quarantine: Quarantine,
                 expected: frozenset[str] = frozenset(), model_config: ModelConfig | None = None) -> None:
        self.workers = workers
        self.link = link
        self.config = config
        self.metrics = metrics
        self.preprocessors = preprocessors
        self.quarantine = quarantine
        self.expected = expected
        self.model_config = model_config
        self.load: dict[str, int] = {}  # instance -> embeddings this process has in flight on it
        self._turn = 0  # rotates the order among equally loaded workers
        self.cold: ColdGate | None = None  # holds requests for a cold model (the frontend actor sets it)

    # --- HTTP ---------------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        m = self.metrics
        body = await read_body(request, self.config.body_timeout, self.config.max_body_bytes, m)
        model = "unknown"
        status = 500
        span = request_trace.http(request, ENDPOINT)  # the HTTP request alone (the fan-out is not traced)
        try:
            req = parse_embedding(body)
            try:
                entry, lora, name = resolve(self.workers, req.model, self.expected)
            except NotReady:
                # a cold model: held until a replica is back (cold.ColdGate), as chat requests are
                held = held_model(req.model, self.expected)
                if self.cold is None or held is None or not await self.cold.hold(held):
                    raise
                entry, lora, name = resolve(self.workers, req.model, self.expected)
            if lora is not None:  # an embed worker loads no adapters: the base model's vector would be a lie
                raise BadRequest(f"{name} is a LoRA adapter: embeddings come from base models only", param="model")
            model = entry.name
            series = m.model(model)
            pre = await self.preprocessors.get(entry)
            trusted = self.config.trust_request_chat_template
            plan = plan_embedding(req, entry, name, pre, trusted) if len(body) < _INLINE_BODY \
                else await asyncio.to_thread(plan_embedding, req, entry, name, pre, trusted)
            for ids in plan.prompts:
                series.input_tokens.observe(len(ids))
            series.inflight.inc()
            try:
                replies, served = await self.embed_all(plan, target=request.headers.get(WORKER_HEADER),
                                                       on_migrate=series.migrations.inc,
                                                       on_quarantine=series.quarantined.inc)
            finally:
                series.inflight.dec()
            pool = next((c.pool for c in entry.cards.values() if c.role == "embed"), None)
            series.pool(pool).duration.observe(time.perf_counter() - t0)
            status = 200
            headers = {WORKER_HEADER: ",".join(dict.fromkeys(served))}
            if plan.encoding_format in ("bytes", "bytes_only"):
                body, meta = binary_response(plan, replies)
                return web.Response(body=body, content_type="application/octet-stream", headers={**headers, **meta})
            return web.Response(body=encode_json(shape_response(plan, replies)), content_type="application/json",
                                headers=headers)
        except ActorError as e:
            status = e.code
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499
            m.disconnects.labels(model).inc()
            m.cancellations.labels(model).inc()
            log.info("client disconnected from an embeddings request; worker requests cancelled")
            raise
        finally:
            m.request_done(ENDPOINT, model, status)
            request_trace.http_done(span, status, None if model == "unknown" else model)

    # --- fan-out ------------------------------------------------------------------------------------
    async def embed_all(self, plan: EmbedPlan, *, target: str | None = None,
                        on_migrate: Callable[[], None] | None = None,
                        on_quarantine: Callable[[], None] | None = None) -> tuple[list[EmbedReply], list[str]]:
        """Every input's embedding, in input order, with the instance that served each. The first
        input that fails for good fails the request, and the others' requests are cancelled."""
        inputs = [_Input(i, ids) for i, ids in enumerate(plan.prompts)]
        if len(inputs) == 1:  # the common case: no task
            reply = await self._embed_one(plan, inputs[0], target, on_migrate, on_quarantine)
            return [reply], [inputs[0].worker or ""]
        replies: list[EmbedReply | None] = [None] * len(inputs)
        todo = iter(inputs)

        async def runner() -> None:  # MAX_PARALLEL_INPUTS of these share the inputs, in order
            for inp in todo:
                replies[inp.index] = await self._embed_one(plan, inp, target, on_migrate, on_quarantine)

        tasks = [asyncio.ensure_future(runner()) for _ in range(min(len(inputs), MAX_PARALLEL_INPUTS))]
        try:
            await asyncio.gather(*tasks)
        finally:
            # a failure (or the client leaving) stops the rest; cancelling a finished task is a no-op
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [r for r in replies if r is not None], [inp.worker or "" for inp in inputs]

    def _settings(self, entry: ModelEntry) -> tuple[int, float]:
        mc = self.model_config if self.model_config and self.model_config.name == entry.name else None
        return (mc.migration_limit if mc is not None else entry.card.migration_limit,
                mc.migration_wait if mc is not None else MIGRATION_WAIT)

    async def _embed_one(self, plan: EmbedPlan, inp: _Input, target: str | None,
                         on_migrate: Callable[[], None] | None,
                         on_quarantine: Callable[[], None] | None) -> EmbedReply:
        limit, wait = self._settings(plan.entry)
        fp: str | None = None
        if self.quarantine:
            fp = fingerprint(plan.entry.name, None, inp.ids, None, _NO_SAMPLING)
            self.quarantine.check(fp)
        attempt = 0
        while True:
            if not await self.link.connected():
                raise BusUnavailable("this frontend is cut off from the bus (reconnecting); try again")
            worker = await self._choose(plan.entry.name, inp, target if attempt == 0 or not inp.failed else None,
                                        wait if attempt else 0.0)
            rid = f"{plan.request_id}-{inp.index}" + (f"-m{attempt}" if attempt else "")
            req = EmbedRequest(request_id=rid, token_ids=inp.ids, dimensions=plan.dimensions,
                               use_activation=plan.use_activation)
            self.load[worker.instance] = self.load.get(worker.instance, 0) + 1
            try:
                reply = await self.link.embed(worker, req)
                inp.worker = worker.instance
                return reply
            except asyncio.CancelledError:
                # the client left (or a sibling input failed): the worker need not finish it
                await asyncio.shield(self.link.cancel(worker, rid))
                raise
            except (*MIGRATABLE, Unavailable) as e:
                err: ActorError = e
            finally:
                left = self.load.get(worker.instance, 1) - 1
                if left > 0:
                    self.load[worker.instance] = left
                else:
                    self.load.pop(worker.instance, None)
            if isinstance(err, RequestTimeout):
                await self.link.cancel(worker, rid)  # no answer in time: do not let it run on
            died = await self._judge(worker, err, inp)
            if died and len(inp.deaths) >= DEATHS_TO_QUARANTINE:
                if on_quarantine is not None:
                    on_quarantine()
                raise self.quarantine.add(fp or fingerprint(plan.entry.name, None, inp.ids, None, _NO_SAMPLING),
                                          rid, inp.deaths)
            attempt += 1
            if attempt > limit:
                if isinstance(err, Overloaded) and not inp.deaths:
                    raise err
                raise MigrationExhausted(f"embedding input {inp.index}: worker {worker.instance} failed ({err}); "
                                         f"migration limit {limit} reached")
            log.warning("embedding %s: %s failed (%s); sending it to another worker, attempt %d/%d",
                        rid, worker.instance, err, attempt, limit)
            if on_migrate is not None:
                on_migrate()

    async def _judge(self, worker: Worker, err: ActorError, inp: _Input) -> bool:
        """After a failed attempt, as a completion's flow judges one: the worker is excluded for
        this input unless it lives and only the bus failed; True when it died while serving it."""
        if isinstance(err, EngineDead):
            died = True
        elif isinstance(err, Overloaded):  # refused (busy, asleep, restarting): not a death
            died = False
        else:
            verdict = await self.link.liveness(worker)
            if verdict is Liveness.ALIVE and not isinstance(err, RequestTimeout):
                return False  # the bus lost the answer: the same worker may serve it again
            # "no responders" before any answer: it never reached a live worker (a record that
            # outlived its process), so no death coincided with it; a silent one that is gone did die
            died = verdict is Liveness.DEAD and not isinstance(err, Unavailable)
            if verdict is Liveness.DEAD:
                inp.gone.add(worker.instance)
        inp.failed[worker.instance] = worker.started_at
        if died:
            inp.gone.add(worker.instance)
            inp.deaths.append(worker.instance)
        return died

    async def _choose(self, model: str, inp: _Input, target: str | None, wait: float) -> Worker:
        """The embedding worker with the fewest embeddings in flight from here (never one that
        failed this input, unless it has restarted since); ``target`` pins one (the
        x-worker-instance-id header). With none left, wait up to ``wait`` seconds for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            pool = self.workers.workers(model, "embed")
            for w in pool:  # an instance that restarted in place is a new incarnation
                if w.instance in inp.failed and w.started_at != inp.failed[w.instance]:
                    del inp.failed[w.instance]
            if target is not None:
                for w in pool:
                    if w.instance == target:
                        if target in inp.failed:
                            raise Overloaded(f"worker {target} failed for this request")
                        return w
                raise NotFound(f"worker instance {target!r} is not serving this model")
            cands = [w for w in pool if w.instance not in inp.failed]
            if cands:
                self._turn += 1
                n = len(cands)
                return min((cands[(self._turn + i) % n] for i in range(n)),
                           key=lambda w: self.load.get(w.instance, 0))
            # only a worker that died or left the pool comes back (restarted); one that failed the
            # input but still runs (refused it, or its answer was lost) is not replaced: 503 at once
            present = {w.instance for w in pool}
            if inp.failed and not any(i in inp.gone or i not in present for i in inp.failed):
                raise Overloaded(f"no embedding worker can take this input now: {', '.join(sorted(inp.failed))} "
                                 f"failed it and still run; try again")
            if loop.time() >= deadline:
                if wait > 0:
                    raise Overloaded(f"no embedding worker came back within {wait:g}s")
                raise Overloaded("no worker available for this model")
            await asyncio.sleep(0.1)
