"""EngineActor: the transport around EngineService (generate + control endpoints on NATS).

Subjects: ``ns.<pool>.generate`` (queue group: any replica) and ``ns.<pool>.generate.<instance>``
(routed); control on ``ns.worker.<instance>.<verb>`` — sleep, wake_up, clear_kv_blocks, health,
stats, cancel, and the engine-side adapter verbs the LoRA manager calls (engine.lora_add|remove|list).
An encode worker (E/P/D, role "encode") also serves ``ns.worker.<instance>.encode`` (EncodeRequest →
EncodeReply, msgpack or JSON like any verb); its generate subjects refuse every request (400). An
embedding worker (role "embed") serves ``ns.worker.<instance>.embed`` (EmbedRequest → EmbedReply)
the same way, and refuses generate too.
Every control endpoint takes header-less JSON (``nats req``). The verbs that change state (sleep,
wake_up, clear_kv_blocks, engine.lora_add|remove, cancel's JSON form) are strict: the payload must
be a JSON object of known fields (``{}`` for the defaults); empty, non-object, malformed or
unknown-field payloads are a 400 and change nothing.

Death: a watcher awaits ``engine.dead``; the in-flight streams end with EngineDead (503 "engine
dead: ...") and then the actor fails, so the worker supervisor (rest_for_one) restarts it — and the
actors after it — with a fresh engine that registers again. An engine that rejects its
configuration at start fails the actor with ``Misconfigured`` instead: the worker supervisor gives up
at once and the process exits with EXIT_CONFIG, whose parent stops restarting it after the same
error a few times (``engine_errors.start_failure``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from nats.aio.msg import Msg

from actors.base import Actor, Endpoint
from actors.engines.protocol import Engine
from actors.instances.contract import WORKER_KIND, InstanceRecord, ModelCard
from actors.worker import contract as C
from actors.worker.contract import (
    ClearKvBlocksRequest,
    EmbedReply,
    EmbedRequest,
    EncodeReply,
    EncodeRequest,
    EngineDead,
    EngineKvSources,
    EngineLoraAdd,
    EngineLoraList,
    EngineLoraRemove,
    GenerateChunk,
    GenerateRequest,
    HealthReply,
    SleepRequest,
    StatusReply,
    WakeUpRequest,
)
from actors.worker.engine_errors import start_failure
from actors.worker.health import probe_worker
from actors.worker.metrics import WorkerMetrics, load_reports
from actors.worker.serving import EngineService
from actors.worker.sleep import SleepController
from bus import codec, tracing
from bus import subjects as S
from bus.errors import BadRequest, NotFound
from bus.registry import Registry
from bus.rpc import respond
from bus.stream_responder import StreamCancels
from bus.tasks import cancel_and_wait
from config.topology import ModelConfig, PoolConfig

log = logging.getLogger(__name__)

GENERATE_ENDPOINTS = ("generate", "generate_instance")
# what a sleeping worker unsubscribes: the work endpoints (encode exists on encode workers only,
# embed on embedding workers only)
WORK_ENDPOINTS = (*GENERATE_ENDPOINTS, "encode", "embed")
# what the ready and liveness probes did not get, per role
_PROBE_WORDS = {"encode": ("encoded no image", "encoder"), "embed": ("embedded no prompt", "pooling engine")}
# How long in-flight streams get to deliver their EngineDead error before the actor fails.
_DEATH_GRACE = 2.0


class _EngineCancels(StreamCancels):
    """Cancel subject of the engine actor.

    Accepts the stream protocol's cancel (``Request-Id`` header = the stream's id: the stream task is
    cancelled, which aborts the engine request) and the CLI's ``{"request_id": "<engine request id>"}``
    (the engine request is aborted and its stream ends with finish_reason "abort").
    """

    def __init__(self, actor: EngineActor) -> None:
        super().__init__()
        self.actor = actor
        self.engine_ids: dict[str, str] = {}  # stream request id -> engine request id

    async def handle(self, msg: Msg) -> None:
        rid = (msg.headers or {}).get(S.REQUEST_ID)
        if not rid:
            body = msg.data.strip()
            if body.startswith(b"{"):  # strict: unknown fields are a 400 (BadRequest -> 400 reply)
                req = codec.decode(body, msg.headers, C.CancelRequest, allow_empty=False)
                rid = req.request_id
            else:
                try:
                    rid = body.decode().strip('"')
                except UnicodeDecodeError:
                    raise BadRequest("cancel: the request id is not valid UTF-8") from None
        if not rid:
            raise BadRequest("cancel needs a request_id")
        svc = self.actor.service
        if rid in self.tasks:
            eid = self.engine_ids.get(rid)
            if eid is not None:
                svc.mark_abort(eid, "cancel")
            found = self.cancel(rid)
        elif rid in svc.active_ids():
            await svc.cancel(rid)
            self.cancelled += 1
            found = True
        else:
            found = False
        if msg.reply:
            if not found:
                raise NotFound(f"no request {rid} in flight")
            await respond(msg, StatusReply(status="ok", message=f"request {rid} cancelled"))


def _external_hits(engine: Engine) -> int:
    sink = getattr(engine, "stats_sink", None)  # vLLM: connector hits per DP rank; the mocker has none
    return int(sum(getattr(sink, "external_hits", {}).values())) if sink is not None else 0


class EngineActor(Actor):
    kind = WORKER_KIND
    description = "vLLM-style engine worker: generate (streaming) and control"
    deregister_grace = 0.5

    def __init__(self, bus: Any, *, pool_name: str, pool: PoolConfig, model: ModelConfig | None,
                 engine_factory: Callable[[], Engine], instance: str | None = None,
                 max_concurrency: int = 1024, load_interval: float = 1.0, engine: Engine | None = None) -> None:
        super().__init__(bus, instance=instance, role=pool.role, model=model.name if model else "",
                         max_concurrency=max_concurrency, drain_timeout=pool.supervisor.drain_timeout)
        self.pool_name = pool_name
        self.pool = pool
        self.model_cfg = model
        self.metrics = WorkerMetrics(self.instance, self.model)
        # engine: already started (checkpoint restore), adopted by the first start instead of built
        self.service = EngineService(engine_factory, pool, model=model, metrics=self.metrics, engine=engine)
        self.sleeper = SleepController(self.service, register=self._register, deregister=self._deregister,
                                       config=pool.sleep)
        self.cancels = _EngineCancels(self)
        self.load_interval = load_interval
        self._tasks: list[asyncio.Task[None]] = []
        self._models: Registry | None = None

    # --- identity ----------------------------------------------------------------------------------
    def cancel_subject(self) -> str:
        return self.bus.subjects.worker_cancel(self.instance)

    def record(self, status: str | None = None) -> InstanceRecord:
        """``status``: what to register as (default: "sleeping" while asleep, else "ready")."""
        facts = self.service.engine.facts if self.service._engine is not None else None
        return InstanceRecord(
            instance=self.instance, kind=self.kind, role=self.role, model=self.model, host=self.bus.host,
            pid=os.getpid(), pool=self.pool_name,
            generate_subject=self.bus.subjects.generate_instance(self.pool_name, self.instance),
            block_size=facts.block_size if facts else None, dp_size=facts.dp_size if facts else 1,
            status=status or ("sleeping" if self.service.sleeping else "ready"), started_at=self.started_at)

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "pool": self.pool_name}

    def model_card(self) -> ModelCard:
        f = self.service.engine.facts
        m = self.model_cfg
        return ModelCard(served_model_name=f.served_model_name, pool=self.pool_name, role=self.role,
                         model_path=f.model_path, tokenizer_path=f.tokenizer_path,
                         context_length=self.service.max_model_len, kv_block_size=f.block_size,
                         total_kv_blocks=f.total_kv_blocks, dp_size=f.dp_size,
                         migration_limit=m.migration_limit if m else 3,
                         chat_template=m.chat_template if m else None,
                         vocab_size=f.vocab_size, max_logprobs=f.max_logprobs,
                         hidden_size=f.hidden_size, prompt_embeds=self.pool.prompt_embeds,
                         input_modalities=list(f.input_modalities),
                         embedding_size=f.embedding_size if self.role == "embed" else None,
                         is_matryoshka=f.is_matryoshka,
                         matryoshka_dimensions=list(f.matryoshka_dimensions) if f.matryoshka_dimensions else None)

    def statistics(self) -> dict[str, Any]:
        svc = self.service
        stats = svc.engine.stats() if svc._engine is not None else []
        return {"pool": self.pool_name, "role": self.role, "generate_in_flight": svc.in_flight(),
                "accepting": svc.accepting, "sleeping": svc.sleeping, "dead": svc.dead,
                "num_running": sum(s.num_running for s in stats),
                "num_waiting": sum(s.num_waiting for s in stats),
                "kv_usage": max((s.kv_usage for s in stats), default=0.0),
                # prompt tokens a KV connector brought in from elsewhere (disaggregated decode)
                "external_prefix_hits": _external_hits(svc.engine) if svc._engine is not None else 0}

    # --- endpoints ---------------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        sj = self.bus.subjects
        w = lambda verb: sj.worker(self.instance, verb)  # noqa: E731
        own = {"encode": [Endpoint("encode", w(C.VERB_ENCODE), self.encode, EncodeRequest, queue_group=None)],
               "embed": [Endpoint("embed", w(C.VERB_EMBED), self.embed, EmbedRequest, queue_group=None)]}
        return [*own.get(self.role, []),
            Endpoint("generate", sj.generate(self.pool_name), self.generate, GenerateRequest, streaming=True),
            Endpoint("generate_instance", sj.generate_instance(self.pool_name, self.instance), self.generate,
                     GenerateRequest, streaming=True, queue_group=None),
            Endpoint("sleep", w(C.VERB_SLEEP), self.sleep, SleepRequest, queue_group=None, bounded=False,
                     allow_empty=False),
            Endpoint("wake_up", w(C.VERB_WAKE_UP), self.wake_up, WakeUpRequest, queue_group=None, bounded=False,
                     allow_empty=False),
            Endpoint("clear_kv_blocks", w(C.VERB_CLEAR_KV_BLOCKS), self.clear_kv_blocks, ClearKvBlocksRequest,
                     queue_group=None, bounded=False, allow_empty=False),
            Endpoint("health", w(C.VERB_HEALTH), self.health, queue_group=None, bounded=False),
            Endpoint("stats", w(C.VERB_STATS), self.stats, queue_group=None, bounded=False),
            Endpoint("lora_add", w(C.ENGINE_LORA_ADD), self.lora_add, EngineLoraAdd, queue_group=None,
                     bounded=False, allow_empty=False),
            Endpoint("lora_remove", w(C.ENGINE_LORA_REMOVE), self.lora_remove, EngineLoraRemove,
                     queue_group=None, bounded=False, allow_empty=False),
            Endpoint("lora_list", w(C.ENGINE_LORA_LIST), self.lora_list, queue_group=None, bounded=False),
            Endpoint("kv_sources", w(C.ENGINE_KV_SOURCES), self.kv_sources, queue_group=None, bounded=False),
        ]

    async def generate(self, req: GenerateRequest, headers: Mapping[str, str]) -> AsyncIterator[GenerateChunk]:
        stream_id = headers.get(S.REQUEST_ID)
        # a worker traces only as part of a frontend's sampled trace: what carries no traceparent
        # (an unsampled request, a `nats req` by hand) makes no span here
        span = self._span(req, headers) if tracing.enabled() and S.TRACEPARENT in headers else None
        try:
            chunks = self.service.generate(req, request_id=stream_id,  # validation errors raise here
                                           trace=tracing.context_of(span))
        except BaseException as e:
            tracing.end(span, e)
            raise
        if stream_id:
            self.cancels.engine_ids[stream_id] = self.service.engine_request_id(req, stream_id)
        if stream_id or span is not None:
            return self._forget(stream_id, chunks, span)
        return chunks

    def _span(self, req: GenerateRequest, headers: Mapping[str, str]) -> Any:
        """This worker's span of a request, under the frontend's attempt span its ``traceparent``
        names (a sampled one: the frontend sends none for a trace it does not record)."""
        return tracing.start("worker.generate", tracing.extract(headers), kind="server",
                             attributes={"vllm_actors.worker_id": self.instance, "vllm_actors.pool": self.pool_name,
                                         "vllm_actors.role": self.role, "vllm_actors.request_id": req.request_id})

    async def _forget(self, stream_id: str | None, chunks: AsyncIterator[GenerateChunk],
                      span: Any = None) -> AsyncIterator[GenerateChunk]:
        try:
            async for c in chunks:
                yield c
        finally:
            if stream_id:
                self.cancels.engine_ids.pop(stream_id, None)
            await chunks.aclose()  # type: ignore[attr-defined]
            tracing.end(span, sys.exc_info()[1])  # what leaves the stream, if anything

    async def encode(self, req: EncodeRequest, _h: Mapping[str, str]) -> EncodeReply:
        return await self.service.encode(req)

    async def embed(self, req: EmbedRequest, _h: Mapping[str, str]) -> EmbedReply:
        return await self.service.embed(req)

    async def sleep(self, req: SleepRequest, _h: Mapping[str, str]) -> StatusReply:
        with self.metrics.track("sleep"):
            return await self.sleeper.sleep(req)

    async def wake_up(self, _req: WakeUpRequest, _h: Mapping[str, str]) -> StatusReply:
        with self.metrics.track("wake_up"):
            return await self.sleeper.wake_up()

    async def clear_kv_blocks(self, _req: ClearKvBlocksRequest, _h: Mapping[str, str]) -> StatusReply:
        with self.metrics.track("clear_kv_blocks"):
            return await self.service.clear_kv_blocks()

    async def health(self, _req: Any, _h: Mapping[str, str]) -> HealthReply:
        with self.metrics.track("health"):
            reply = await self.service.health(self.pool.health.timeout)
            reply.instance = self.instance
            return reply

    async def stats(self, _req: Any, _h: Mapping[str, str]) -> dict[str, Any]:
        return self._stats_data()

    async def lora_add(self, req: EngineLoraAdd, _h: Mapping[str, str]) -> StatusReply:
        with self.metrics.track("lora_add"):
            return await self.service.lora_add(req)

    async def lora_remove(self, req: EngineLoraRemove, _h: Mapping[str, str]) -> StatusReply:
        with self.metrics.track("lora_remove"):
            return await self.service.lora_remove(req.lora_name)

    async def lora_list(self, _req: Any, _h: Mapping[str, str]) -> EngineLoraList:
        return EngineLoraList(adapters=self.service.lora_list())

    async def ready_probe(self) -> None:
        """Ready means serving: before the instance is registered, one token is generated through
        our own routed generate subject (the bus, the subscription and the engine all answer); an
        encode worker encodes its built-in image through its own encode subject instead, an
        embedding worker embeds a short prompt through its embed subject."""
        if self.service.sleeping:
            return  # registered as "sleeping": not routable, nothing to prove yet
        deadline = self.pool.health.timeout
        try:
            await probe_worker(self.bus, self.pool_name, self.instance, self.role, 0, deadline)
        except TimeoutError:
            did = _PROBE_WORDS.get(self.role, ("produced no token", ""))[0]
            raise EngineDead(f"engine of {self.instance} {did} within {deadline:g}s of start") from None
        log.info("%s: %s answered its readiness probe; registering", self.instance,
                 _PROBE_WORDS.get(self.role, ("", "engine"))[1])

    async def kv_sources(self, _req: Any, _h: Mapping[str, str]) -> EngineKvSources:
        eng = self.service.engine
        return EngineKvSources(block_size=eng.facts.block_size, sources=eng.kv_event_sources())

    # --- lifecycle ---------------------------------------------------------------------------------
    async def on_start(self) -> None:
        try:
            await self.service.start()
        except BaseException as e:
            await self.service.shutdown()
            failure = start_failure(e)
            if failure is not e:
                log.error("%s: %s; a restart would fail the same way", self.instance, failure)
                raise failure from e
            raise
        self._models = self.bus.registry(self.bus.subjects.bucket_models, self.registry_ttl)
        try:
            await self._models.ensure()
            await self._models.register(f"{self.model_card().served_model_name}.{self.pool_name}",
                                        self.model_card())
        except Exception:
            await self.service.shutdown()
            raise
        self._tasks = [asyncio.create_task(self._watch_death(), name=f"{self.instance}-death"),
                       asyncio.create_task(self._report_load(), name=f"{self.instance}-load")]
        self.sleeper.start_idle_watch()

    async def on_stop(self) -> None:
        await self.sleeper.stop_idle_watch()
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._models is not None:
            # not deregister: other replicas share the model card; it expires if none refreshes it
            await self._models.close()
        await self.service.shutdown()

    async def stop(self, timeout: float | None = None) -> None:
        self.service.stopping = True  # streams cut by the drain deadline count as "shutdown" aborts
        stalled = self.service.stalled_for()
        if timeout is not None and stalled >= self.pool.health.timeout:
            # a hung engine (what the health monitor escalates) will not drain: do not wait for it
            log.warning("%s: engine produced nothing for %.1fs; stopping without drain", self.instance, stalled)
            timeout = None
        timer = None
        if timeout is not None and self.service.in_flight():
            # shortly before the drain deadline cuts the streams, abort what is left in the engine so
            # each stream ends with a typed 503 ("worker shutting down") the frontend can migrate
            drain = min(self.drain_timeout, timeout)
            timer = asyncio.get_running_loop().call_later(
                max(0.0, drain - min(1.0, drain / 4)),
                lambda: asyncio.ensure_future(self.service.abort_all("shutdown")))
        try:
            await super().stop(timeout)
        finally:
            if timer is not None:
                timer.cancel()

    async def _watch_death(self) -> None:
        eng = self.service.engine
        await eng.dead.wait()
        log.error("engine of %s died; ending %d stream(s) and failing for a restart", self.instance,
                  self.service.in_flight())
        self.service.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _DEATH_GRACE
        while self.service.in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.fail(EngineDead(f"engine dead: instance {self.instance}"))

    async def _report_load(self) -> None:
        subject = self.bus.subjects.load(self.instance)
        hdrs = codec.headers_for(True)
        while True:
            try:
                engine = self.service.engine
                stats = engine.stats()
                self.metrics.update_engine(stats)
                idle = (None if self.service.in_flight()
                        else round(time.monotonic() - self.service.last_activity(), 3))
                for rep in load_reports(self.instance, stats, steps=engine.take_steps(), idle_s=idle):
                    await self.bus.nc.publish(subject, codec.encode(rep, msgpack=True), headers=hdrs)
            except Exception as e:  # noqa: BLE001 - a missed report is harmless; keep reporting
                log.debug("load report failed: %s", e)
            await asyncio.sleep(self.load_interval)

    # --- sleep hooks: out of routing (record "sleeping") and off the generate subjects, and back -----
    async def _deregister(self) -> None:
        # the record stays, as "sleeping": routers and readiness skip it, while a frontend sees a
        # cold model (not a missing one) and a waker finds the replica to wake
        if self.registry is not None:
            await self.registry.register(self.instance, self.record(status="sleeping"))
        await self._set_generate_subscribed(False)

    async def _register(self) -> None:
        await self._set_generate_subscribed(True)
        if self.registry is not None:
            await self.registry.register(self.instance, self.record())

    async def _set_generate_subscribed(self, on: bool) -> None:
        """Unsubscribe the generate (and encode) endpoints while asleep, so the pool's queue group
        delivers to awake replicas only (the admission gate covers messages already in flight)."""
        svc = self._service
        if svc is None:
            return
        await (svc.resume(WORK_ENDPOINTS) if on else svc.pause(WORK_ENDPOINTS))
