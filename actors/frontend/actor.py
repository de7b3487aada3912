"""FrontendActor: the OpenAI HTTP server as a supervised actor on the bus.

It watches the registry (ns-instances, ns-models, ns-loras: one ``actors.instances`` watch each,
which its KV router's feed shares) into a WorkerSet, serves HTTP on
``FrontendConfig.http`` and registers a micro service (``nats micro info frontend``) whose
``status`` endpoint reports what it sees, plus an instance record in ns-instances. With the ``kv``
router it also serves ``ns.router.*`` (route, finish, index.stats, index.dump: actors.router.service)
over its own in-process router, the only KV router of the process. Every
``frontend.observe_interval`` seconds it publishes what it saw of its engine requests (a
``FrontendWindow``, JSON, empty ones too) on ``ns.metrics.frontend.<instance>`` for the planner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from actors.base import Actor, Endpoint
from actors.instances.watch import BucketWatch, watch_instances, watch_models
from actors.planner.contract import Demand, WakeOutcome
from actors.router.service import RouterEndpoints, RouterState
from bus import codec, rpc
from bus.addresses import split_hostport
from bus.connection import flush_in_order
from bus.context import BusContext
from bus.tasks import cancel_and_wait
from config.topology import FrontendConfig, ModelConfig, PlannerConfig, PoolConfig

from . import metrics_merge
from .app import FrontendApp
from .client import WorkerClient
from .cold import ColdGate
from .confirm import InstanceConfirmer
from .discovery import WorkerSet
from .http_guard import GuardedSite
from .kv_routing import KvPolicy
from .metrics import FrontendMetrics
from .observations import Observations
from .readiness import PoolExpectation, Readiness, WakeState
from .response_store import ResponseStore
from .routing import Router, make_router
from .shared_quarantine import SharedQuarantine
from .worker_load import WorkerLoad, WorkerLoadFeed

log = logging.getLogger(__name__)

# seconds a frontend process that shares its address waits for its first probes of the workers
SETTLE_TIMEOUT = 3.0


class FrontendActor(Actor):
    kind: ClassVar[str] = "frontend"
    description: ClassVar[str] = "OpenAI-compatible HTTP frontend"

    def __init__(self, bus: BusContext, *, config: FrontendConfig | None = None,
                 model_config: ModelConfig | None = None, instance: str | None = None,
                 registry_ttl: float | None = None, pools: Mapping[str, PoolConfig] | None = None,
                 supervisor_hosts: list[str] | None = None, on_status: Callable[[str], None] | None = None,
                 extra_metrics: Sequence[CollectorRegistry] = (), link: socket.socket | None = None,
                 planner: PlannerConfig | None = None, **kw: Any) -> None:
        """``extra_metrics``: other registries of this process that /metrics serves (the planner's).
        ``link``: this process's end of the connection hand-over with the root, which accepts on
        ``config.http`` for the deployment's frontend processes (``frontend.processes`` > 1,
        ``actors.frontend.handoff``); with it, routing bookings, quarantine and /metrics are shared."""
        self.config = config or FrontendConfig()
        self.model_config = model_config
        super().__init__(bus, instance=instance, role="frontend",
                         model=model_config.name if model_config else "", **kw)
        if registry_ttl is not None:
            self.registry_ttl = registry_ttl
        decode_only = model_config.allow_decode_only if model_config is not None else True
        self.workers = WorkerSet(verify=True, decode_only=lambda _m: decode_only)
        # a pool that idle stop or the planner (min_replicas = 0) takes to zero: a replica out of the
        # registry while its process drains is on its way to zero (cold), not failing
        expected = [PoolExpectation(name, p.role, p.replicas, p.host, idle_stop=p.sleep.idle_stop is not None
                                    or (planner is not None and planner.to_zero(name, p)))
                    for name, p in (pools or {}).items()]
        self.readiness = Readiness(model_config.name if model_config else None, expected,
                                   decode_fallback=decode_only, wake=self._wake_state)
        # roots whose children views say what a missing worker is doing (one per host)
        self.supervisor_hosts = supervisor_hosts or []
        self.on_status = on_status
        # (when read, child id -> view, whether every root answered that time)
        self._children: tuple[float, dict[str, dict[str, Any]], bool] = (0.0, {}, False)
        self.cold: ColdGate | None = None
        self._outcome_sub: Any = None
        self._last_ready: bool | None = None
        self._confirmer: InstanceConfirmer | None = None
        self.metrics = FrontendMetrics(observations=Observations(self.instance, self.model or None),
                                       extra=extra_metrics)
        # every worker's load reports, on this /metrics whichever router runs
        self.worker_load = WorkerLoad(self.workers.records, self.metrics.prefix)
        self.metrics.registry.register(self.worker_load)
        self._load_feed = WorkerLoadFeed(bus, self.worker_load)
        self._observer: asyncio.Task[None] | None = None
        self._router: Router | None = None
        self.app: FrontendApp | None = None
        self._site: GuardedSite | None = None
        # one watch per bucket for the whole process (the KV router's feed shares ns-instances)
        self.instances = watch_instances(bus, self.registry_ttl)
        self._watches: list[BucketWatch[Any]] = [
            self.instances, watch_models(bus, self.registry_ttl),
            BucketWatch(bus.js, bus.subjects.bucket_loras, self.registry_ttl, dict[str, Any])]
        self._unsubscribe: list[Callable[[], None]] = []
        self.port: int | None = None
        self.link = link
        self.shared_quarantine: SharedQuarantine | None = None
        self._scrape_sub: Any = None

    # --- actor hooks -----------------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        eps = [Endpoint("status", self.bus.subjects.actor(self.kind, self.instance, "status"),
                        self._status, queue_group=None, bounded=False)]
        if self.config.router == "kv":  # ns.router.*: this process's one KV router, on the bus
            eps += RouterEndpoints(self._kv_router_state).endpoints(self.bus.subjects)
        return eps

    def _kv_router_state(self) -> RouterState | None:
        current = getattr(self._router, "current", None)
        return current() if current is not None else None

    async def _status(self, req: Any, headers: Any) -> dict[str, Any]:
        return {"instance": self.instance, "http": self.config.http, "port": self.port,
                "router": self.config.router, "models": sorted(self.workers.models),
                "loras": sorted(self.workers.loras),
                "workers": [w.instance for w in self.workers.ready_instances()]}

    def statistics(self) -> dict[str, Any]:
        return {"models": len(self.workers.models), "workers": len(self.workers.ready_instances()),
                "http": self.config.http}

    async def on_start(self) -> None:
        ws = self.workers
        instances, models, loras = self._watches
        self._confirmer = InstanceConfirmer(self.bus, ws, instances.registry)
        self._unsubscribe = [instances.subscribe(self._confirmer.put, self._confirmer.delete),
                             models.subscribe(ws.put_model, ws.delete_model),
                             loras.subscribe(ws.put_lora, ws.delete_lora)]
        ws.listeners.append(self._readiness_changed)
        try:
            for watch in self._watches:
                await watch.start()
        except BaseException:
            await self._cleanup()
            raise
        model = self.model_config.name if self.model_config else None

        shared = self.link is not None

        def kv() -> KvPolicy:
            return KvPolicy(ws, self.bus, self.instances, self.config, model, registry=self.metrics.registry,
                            share_as=self.instance if shared else None)

        router = make_router(self.config.router, kv_factory=kv)
        self._router = router
        client = WorkerClient(self.bus, self.config.stall_timeout)
        store = ResponseStore(self.bus.js, self.bus.subjects.bucket_responses, self.config.responses,
                              self.bus.kv_replicas)
        self.app = FrontendApp(workers=ws, router=router, link=client, config=self.config,
                               model_config=self.model_config, metrics=self.metrics, health=self.health,
                               response_store=store)
        if shared:
            self.app.process_name = self.instance
        if model is not None:
            self.cold = ColdGate(ws, self.config.cold, frontend=self.instance, is_cold=self._is_cold,
                                 send=self._send_demand, metrics=self.metrics)
            self.app.pipeline.cold = self.cold  # the app's build hands it to /v1/embeddings too
        self._site = GuardedSite(self.app.build(), self.config, self.metrics)
        # vLLM's request models read vllm.envs on every request (3 % of the frontend's CPU under load):
        # cache them, as vllm serve does once it has started; nothing changes them in this process
        import vllm.envs

        vllm.envs.enable_envs_cache()
        host, port = split_hostport(self.config.http)
        try:
            await self._load_feed.start()
            if self.cold is not None:
                self._outcome_sub = await self.bus.nc.subscribe(self.bus.subjects.wake_outcome(),
                                                                cb=self._on_wake_outcome)
            if shared:
                await self._share()
            self.port = await self._site.start(host, port, link=self.link)
        except BaseException:  # a taken port, a bus that does not answer the shared parts' setup, a stop
            await self._cleanup()
            raise
        log.info("frontend %s serving OpenAI API on http://%s:%d/v1 (router %s)", self.instance, host,
                 self.port, router.name)
        if self.config.observe_interval > 0:
            self._observer = asyncio.create_task(self._publish_windows(), name=f"{self.instance}-observe")

    async def _share(self) -> None:
        """Several frontend processes: quarantine, /metrics and a settled view, before serving."""
        assert self.app is not None and self._confirmer is not None
        if self.config.quarantine_ttl > 0:
            self.shared_quarantine = SharedQuarantine(self.bus, self.app.pipeline.deps.quarantine, self.instance)
            await self.shared_quarantine.start()
        self._scrape_sub = await self.bus.nc.subscribe(self.bus.subjects.frontend_scrape(), cb=self._on_scrape)
        await flush_in_order(self.bus.nc)  # registered before this process is handed connections
        nc, subject, others = self.bus.nc, self.bus.subjects.frontend_scrape(), self.config.processes - 1

        async def render() -> bytes:
            return await metrics_merge.gather(nc, subject, self.instance, self.metrics.render(), others)

        self.app.render_metrics = render
        # the other processes answer /health from a confirmed view of the workers: a process that
        # (re)starts must not say "not ready" beside them while its first probes are out
        await self._confirmer.settled(SETTLE_TIMEOUT)

    async def _on_scrape(self, msg: Any) -> None:
        if msg.reply:
            await self.bus.nc.publish(msg.reply, metrics_merge.encode_part(self.instance, self.metrics.render()))

    async def on_stop(self) -> None:
        await self._cleanup()

    async def _cleanup(self) -> None:
        await self._load_feed.stop()
        if self._outcome_sub is not None:
            with contextlib.suppress(Exception):
                await self._outcome_sub.unsubscribe()
            self._outcome_sub = None
        if self._scrape_sub is not None:
            with contextlib.suppress(Exception):
                await self._scrape_sub.unsubscribe()
            self._scrape_sub = None
        if self.shared_quarantine is not None:
            await self.shared_quarantine.stop()
            self.shared_quarantine = None
        if self._observer is not None:
            await cancel_and_wait([self._observer])
            self._observer = None
        aclose = getattr(self._router, "aclose", None)
        if aclose is not None:
            await aclose()
        self._router = None
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self.app is not None:
            await self.app.pipeline.aclose()
        for watch in self._watches:
            await watch.stop()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        if self._confirmer is not None:
            await self._confirmer.close()

    async def _publish_windows(self) -> None:
        """One window per interval, on a fixed schedule (a late publish does not shift the next),
        including empty ones: the planner must see zero traffic as zero, not as silence."""
        subject = self.bus.subjects.metrics_frontend(self.instance)
        headers = codec.headers_for(False)
        interval = self.config.observe_interval
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += interval
            delay = due - loop.time()
            if delay < 0:  # the loop fell behind by more than a window: start the schedule anew
                due, delay = loop.time(), 0.0
            await asyncio.sleep(delay)
            window = self.metrics.observations.roll(time.time())
            if self.cold is not None:  # held for a cold model: demand no engine sees yet
                window.held = sum(p.held for p in self.cold.periods.values())
            try:
                await self.bus.nc.publish(subject, codec.encode(window), headers=headers)
            except Exception as e:  # noqa: BLE001 - a lost window is a gap the planner tolerates
                log.debug("frontend window not published: %s", e)

    # --- cold models ----------------------------------------------------------------------------------
    def _wake_state(self, model: str) -> WakeState:
        gate = self.cold
        if gate is None:
            return WakeState()
        return WakeState(waking=gate.waking(model), failure=gate.failure(model))

    async def _is_cold(self, model: str) -> str | None:
        """What readiness says is cold of ``model`` ("sleep", "zero", both joined by "+"), or None."""
        _ready, body = await self.health()
        cold = body.get("cold") or {}
        if body.get("status") != "cold" or cold.get("model") != model:
            return None
        return "+".join(sorted(set(cold.get("pools", {}).values()))) or "unknown"

    async def _send_demand(self, demand: Demand) -> None:
        await self.bus.nc.publish(self.bus.subjects.wake_demand(), codec.encode(demand),
                                  headers=codec.headers_for(False))

    async def _on_wake_outcome(self, msg: Any) -> None:
        try:
            outcome = codec.decode(msg.data, msg.headers, WakeOutcome)
        except Exception as e:  # noqa: BLE001 - anyone on the bus can publish there
            log.debug("bad wake outcome on %s: %s", msg.subject, e)
            return
        if self.cold is not None:
            self.cold.on_outcome(outcome)

    # --- readiness ------------------------------------------------------------------------------------
    async def health(self, detail: bool = True) -> tuple[bool, dict[str, Any]]:
        """/health: readiness from the registry, and what each missing worker is doing from the
        supervisors (asked only while something is missing; cached for a second). Without
        ``detail`` (/v1/models) they are asked only while the model cannot be served, since
        only their views tell a pool at zero replicas (cold) from a missing one."""
        ready, body = self._evaluate()
        pools = body.get("pools", {}).values()
        # a count that differs from the view read last: a replica was spawned or removed since
        if (detail and any(p["missing"] or p["ready"] != p["expected"] for p in pools)) or (
                not detail and self.model and self.model not in self.workers.models):
            await self._refresh_children()
            ready, body = self._evaluate()
        return ready, body

    def _evaluate(self) -> tuple[bool, dict[str, Any]]:
        return self.readiness.evaluate(self.workers, self._children[1], views_complete=self._children[2])

    async def _refresh_children(self) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._children[0] < 1.0:
            return
        views: dict[str, dict[str, Any]] = {}
        failed: list[str] = []

        async def ask(host: str) -> None:
            try:
                reply = await rpc.request(self.bus.nc, self.bus.subjects.supervisor(host, "children"), {},
                                          timeout=0.5)
            except Exception as e:  # noqa: BLE001 - a missing view only makes the body less precise
                log.debug("children of supervisor %s: %s", host, e)
                failed.append(host)
                return
            for child in reply.get("children", []):
                views[child["id"]] = child

        await asyncio.gather(*(ask(h) for h in self.supervisor_hosts))
        if failed:
            # a supervisor that did not answer in time (a busy start-up): keep what it said last and
            # ask again on the next /health instead of caching "unknown" for a second
            self._children = (self._children[0], {**self._children[1], **views}, False)
        else:
            self._children = (now, views, bool(self.supervisor_hosts))

    def _readiness_changed(self) -> None:
        """Log (and report as sd_notify STATUS=) each change between serving and not serving."""
        ready, body = self._evaluate()
        if ready == self._last_ready:
            return
        self._last_ready = ready
        counts = ", ".join(f"{n} {p['ready']}/{p['expected']}" for n, p in body.get("pools", {}).items())
        if ready:
            text = f"serving {', '.join(body['models']) or 'nothing'} (ready workers: {counts or 'n/a'})"
            if body.get("decode_fallback"):
                text += "; decode-only fallback allowed when no prefill worker is ready"
            log.info("frontend %s: %s", self.instance, text)
        else:
            text = f"not ready: {body['status']} (ready workers: {counts or 'none'})"
            (log.warning if body["status"] == "unhealthy" else log.info)("frontend %s: %s", self.instance, text)
        if self.on_status is not None:
            self.on_status(text)

