"""The planner actor: observes over NATS, decides every interval, scales through the supervisors.

Micro service ``planner`` (``nats micro info planner``):

- ``<ns>.planner.status``: mode, targets, budget, each pool's counts, backoff and pending change.
- ``<ns>.planner.decisions`` ``{"limit": N}``: the newest decisions with their reasons and actions.
- ``<ns>.planner.profile`` ``{"pool": NAME}``: the profile throughput mode uses (all pools: a summary).

Each decision is also published on ``<ns>.planner.decision`` (JSON) and counted in the planner's
metrics. Observations: ``<ns>.metrics.frontend.*`` (``FrontendWindow``) and ``<ns>.load.*``
(``LoadReport`` with step samples); which pool an instance serves comes from ``<ns>-instances``.
Every decision starts from the roots' ``children`` views, so a restarted planner resumes from the
replicas that really run.

The planner is also the deployment's waker (no ``WakerActor`` runs beside it): a ``wake.PoolKeeper``
over every pool acts on ``<ns>.wake.demand`` at once (wakes a sleeping replica or spawns one in a
pool at zero) and removes replicas idle past ``sleep.idle_stop``, publishing ``<ns>.wake.outcome``.
The keeper and the planner's own changes of a pool never run at once (``_change``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from nats.aio.msg import Msg

from actors.base import Actor, Endpoint
from actors.instances.contract import InstanceRecord
from actors.instances.watch import BucketWatch, watch_instances
from actors.planner.constraints import PoolLimits, replica_engines
from actors.planner.contract import (
    PLANNER_KIND,
    VERB_DECISIONS,
    VERB_PROFILE,
    VERB_STATUS,
    Action,
    Decision,
    DecisionsRequest,
    FrontendWindow,
    PlannerStatus,
    ProfileRequest,
    profile_summary,
)
from actors.planner.load_model import EngineLoad
from actors.planner.metrics import PlannerMetrics
from actors.planner.observer import Observer
from actors.planner.planner import Planner, PoolState, PoolView, replica_of
from actors.planner.scaler import Scaler
from actors.planner.wake import KeptPool, PoolKeeper
from actors.planner.waker import BusWakeOps, KeeperFeed
from actors.worker.contract import LoadReport
from bus import codec
from bus.context import BusContext
from bus.errors import ActorError, NotFound
from bus.tasks import cancel_and_wait
from config.topology import PlannerConfig, PoolConfig

log = logging.getLogger(__name__)

KEEP_DECISIONS = 256


def pool_states(cfg: PlannerConfig, pools: Mapping[str, PoolConfig], roots: Mapping[str, str],
                profiles: Mapping[str, Path]) -> dict[str, PoolState]:
    """Each pool's limits and profile (``config.paths.profile_path``) from the topology."""
    out = {}
    for name, p in pools.items():
        pp = cfg.pools.get(name)
        limits = PoolLimits(pool=name, host=roots.get(name, p.host), min_replicas=cfg.min_of(name),
                            max_replicas=pp.max_replicas if pp is not None else None,
                            engines_per_replica=replica_engines(cfg, name, p),
                            managed=cfg.scales(name, p))
        st = PoolState(limits=limits, role=p.role, engine=p.engine, profile_path=profiles.get(name))
        if cfg.mode == "throughput" and limits.managed:
            st.load_model()
        out[name] = st
    return out


class PlannerActor(Actor):
    kind: ClassVar[str] = PLANNER_KIND
    description: ClassVar[str] = "SLA planner: scales pools to meet TTFT/ITL targets with the fewest engines"

    def __init__(self, bus: BusContext, *, config: PlannerConfig, pools: Mapping[str, PoolConfig],
                 roots: Mapping[str, str], profiles: Mapping[str, Path], model: str | None = None,
                 metrics: PlannerMetrics | None = None, instance: str | None = None, **kw: Any) -> None:
        """``roots``: pool -> the host token of the root supervisor that runs it; ``profiles``: pool ->
        its profile file (throughput mode)."""
        super().__init__(bus, instance=instance or f"planner-{bus.host}", role="planner", model=model or "",
                         **kw)
        self.config = config
        self.roots = dict(roots)
        self.planner = Planner(config, pool_states(config, pools, roots, profiles), instance=self.instance)
        self.observer = Observer(model, steps=config.mode == "load")
        self.metrics = metrics or PlannerMetrics()
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=KEEP_DECISIONS)
        self.views: dict[str, PoolView] = {}
        self.instances: BucketWatch[InstanceRecord] = watch_instances(bus, self.registry_ttl)
        self.scaler = Scaler(bus.nc, bus.subjects)
        self._subs: list[Any] = []
        self._loop: asyncio.Task[None] | None = None
        self._changes: dict[str, asyncio.Task[None]] = {}
        # cold pools: the keeper wakes or spawns on a frontend's demand at once, not at the next
        # interval (180 s in throughput mode), and removes replicas idle past sleep.idle_stop
        self.keeper = PoolKeeper([KeptPool.of(n, p, self.roots.get(n, p.host)) for n, p in pools.items()],
                                 BusWakeOps(bus, self.instances, self.scaler), instance=self.instance,
                                 model=model, on_busy=self._keeper_busy)
        self.feed = KeeperFeed(bus, self.keeper)

    # --- actor ---------------------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        s = self.bus.subjects
        return [Endpoint(VERB_STATUS, s.planner(VERB_STATUS), self.status, None, bounded=False),
                Endpoint(VERB_DECISIONS, s.planner(VERB_DECISIONS), self.recent, DecisionsRequest, bounded=False),
                Endpoint(VERB_PROFILE, s.planner(VERB_PROFILE), self.profile, ProfileRequest, bounded=False)]

    def statistics(self) -> dict[str, Any]:
        last = self.decisions[-1] if self.decisions else None
        return {"mode": self.config.mode, "no_op": self.config.no_op, "decisions": self.planner.seq,
                "windows_seen": self.observer.windows_seen,
                "replicas": {n: v.current for n, v in self.views.items()},
                "wake_pending": dict(self.keeper.pending), "wakes": len(self.keeper.recent),
                "last_targets": {p.pool: p.target for p in last.pools} if last else {}}

    async def on_start(self) -> None:
        s = self.bus.subjects
        self.instances.subscribe(lambda _k, _r: None, self.observer.forget)
        await self.instances.start()
        self._subs = [await self.bus.nc.subscribe(s.metrics_frontend_all(), cb=self._on_window),
                      await self.bus.nc.subscribe(s.load_all(), cb=self._on_load)]
        await self.feed.start()
        for name, st in self.planner.pools.items():
            if self.config.mode == "throughput" and st.model is None:
                log.warning("planner: pool %s has no usable profile (%s); it keeps its replicas until one "
                            "exists: python -m actors.planner.profile TOPOLOGY --pool %s",
                            name, st.profile_error, name)
        log.info("planner %s: %s mode%s, every %.0fs, TTFT %.0f ms, ITL %.0f ms, budget %d engines, pools %s",
                 self.instance, self.config.mode, " (no-op: decisions only)" if self.config.no_op else "",
                 self.config.effective_interval(), self.config.ttft_target_ms, self.config.itl_target_ms,
                 self.config.budget, ", ".join(self.planner.pools))
        self._loop = asyncio.create_task(self._run(), name=f"planner:{self.instance}")

    async def on_stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be gone already
                pass
        self._subs = []
        await cancel_and_wait([t for t in (self._loop, *self._changes.values()) if t is not None])
        self._changes.clear()
        await self.feed.stop()  # and the keeper's actions in progress
        await self.instances.stop()

    # --- observations --------------------------------------------------------------------------------
    async def _on_window(self, msg: Msg) -> None:
        try:
            self.observer.add_window(codec.decode(msg.data, msg.headers, FrontendWindow))
        except Exception as e:  # noqa: BLE001 - anyone on the bus can publish there
            log.debug("planner: bad frontend window on %s: %s", msg.subject, e)

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = codec.decode(msg.data, msg.headers, LoadReport)
        except Exception as e:  # noqa: BLE001
            log.debug("planner: bad load report on %s: %s", msg.subject, e)
            return
        rec = self.instances.entries.get(report.instance)
        self.observer.add_load(report, rec.pool if rec is not None else None)

    # --- the loop ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        interval = self.config.effective_interval()
        self.observer.take_interval()  # the first interval starts now
        while True:
            await asyncio.sleep(interval)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a decision that fails must not stop the planner
                log.exception("planner %s: decision failed", self.instance)

    async def tick(self) -> Decision:
        """One decision: look, decide, publish, act."""
        self.views = await self._views()
        observed = self.observer.take_interval()
        predicted = None
        if self.config.mode == "throughput":
            for st in self.planner.pools.values():
                if st.model is None:
                    st.load_model()  # a profile written since the last decision is used from now on
            # statsmodels fits block for tens of milliseconds: off the event loop
            predicted = await asyncio.to_thread(self.planner.predict, observed)
        else:
            for name, st in self.planner.pools.items():
                samples = self.observer.take_steps(name)
                if samples:
                    st.regression.fit(samples)
        # both modes: no pool goes to zero while its engines still run or queue requests
        loads = self._loads(observed.isl or self.planner.last_isl or 0.0)
        decision = self.planner.decide(self.views, observed, loads, predicted=predicted)
        self.decisions.append(decision)
        self.metrics.decided(decision)
        for p in decision.pools:
            if p.target != p.current:
                log.info("planner: %s %d -> %d (desired %d: %s%s)%s", p.pool, p.current, p.target, p.desired,
                         p.reason, f"; {p.constraint}" if p.constraint else "",
                         " [no-op]" if self.config.no_op else "")
            else:
                log.debug("planner: %s stays at %d (desired %d: %s%s)", p.pool, p.current, p.desired, p.reason,
                          f"; {p.constraint}" if p.constraint else "")
        await self.bus.nc.publish(self.bus.subjects.planner_decision(), codec.encode(decision),
                                  headers=codec.headers_for(False))
        if not self.config.no_op:
            self._execute(decision)
        return decision

    async def _views(self) -> dict[str, PoolView]:
        views = {name: PoolView(name=name, role=st.role, host=st.limits.host, engine=st.engine)
                 for name, st in self.planner.pools.items()}
        records = [r for r in self.instances.entries.values() if r.is_worker and r.pool in views]
        for r in records:
            views[r.pool].instances.add(r.instance)  # type: ignore[index]
            if r.block_size:
                views[r.pool].block_size = r.block_size  # type: ignore[index]
        for host in sorted({v.host for v in views.values()}):
            try:
                children = await self.scaler.children(host)
            except ActorError as e:
                log.warning("planner: root %s did not answer children (%s); its pools keep their replicas", host, e)
                for v in views.values():
                    if v.host == host:
                        v.known = False
                continue
            for c in children:
                pool = (c.get("meta") or {}).get("pool")
                if pool in views and views[pool].host == host and c.get("state") != "stopped" \
                        and replica_of(c["id"], pool) is not None:
                    views[pool].children.append(c)
        return views

    def _loads(self, isl: float) -> dict[str, list[EngineLoad]]:
        """Each pool's engines as their latest load reports have them (load mode); a waiting
        request is taken to be ``isl`` prompt tokens."""
        busy = self.observer.take_busy()
        out: dict[str, list[EngineLoad]] = {}
        for name, v in self.views.items():
            per: dict[str, EngineLoad] = {}
            for r in self.observer.reports(v.instances):
                e = per.setdefault(r.instance, EngineLoad(instance=r.instance, num_waiting=0, num_running=0,
                                                          kv_tokens=0, queued_prefill_tokens=0,
                                                          busy=busy.get(r.instance, 0.0)))
                e.num_waiting += r.num_waiting
                e.num_running += r.num_running
                e.kv_tokens += r.active_kv_blocks * v.block_size
                e.queued_prefill_tokens += int(r.num_waiting * isl)
            out[name] = list(per.values())
        return out

    # --- acting --------------------------------------------------------------------------------------
    def _execute(self, decision: Decision) -> None:
        by_pool: dict[str, list[Action]] = {}
        for a in decision.actions:
            by_pool.setdefault(a.pool, []).append(a)
        for pool, actions in by_pool.items():
            task = self._changes.get(pool)
            if task is not None and not task.done():
                continue  # decide() already held this pool; a race with a just-finished change
            self._changes[pool] = asyncio.create_task(self._change(pool, actions), name=f"planner:{pool}")

    def _keeper_busy(self, pool: str, what: str | None) -> None:
        """The keeper starts (``what``) or ends (None) a wake or idle stop of ``pool``: decide()
        holds a pool with a pending change, so the planner does not resize it meanwhile."""
        st = self.planner.pools.get(pool)
        if st is not None:
            st.pending = f"{what} (waker)" if what is not None else None

    async def _change(self, pool: str, actions: list[Action]) -> None:
        """Carry out one decision's actions for ``pool``, holding the keeper's lock of the pool.

        Why the keeper's lock rather than routing demand through ``_changes``: the keeper already
        serialises its own wakes and idle stops with that lock, re-reads the pool once it holds it
        (a wake waiting behind our stop of the last replica then spawns one), and skips an idle stop
        while it is taken. Demand is acted on at once, without a decision. The check and the
        acquire below run without a suspension in between (an uncontended ``Lock.acquire`` does
        not yield), so exactly one of the two holds the pool."""
        st = self.planner.pools[pool]
        engine = st.engine
        lock = self.keeper.lock(pool)
        if lock.locked():
            # the keeper started on this pool after the decision: the decision's counts are stale,
            # and the next one decides again (its pending note holds the pool meanwhile)
            log.info("planner: %s changes this pool (%s); the decision's actions are dropped", pool,
                     self.keeper.pending.get(pool, "waker"))
            return
        async with lock:
            await self._act(st, pool, engine, actions)

    async def _act(self, st: PoolState, pool: str, engine: str, actions: list[Action]) -> None:
        try:
            for a in actions:
                st.pending = f"{a.kind} {a.child}"
                log.info("planner: %s %s on %s", a.kind, a.child, a.host)
                done = await (self.scaler.spawn(a.host, pool, replica_of(a.child, pool) or 0, engine)
                              if a.kind == "spawn" else self.scaler.stop(a.host, pool, a.child))
                a.outcome, a.error, a.seconds = done.outcome, done.error, done.seconds
                self.planner.outcome(a)
                self.metrics.acted(a)
                if a.outcome == "failed":
                    log.warning("planner: %s %s failed after %.1fs: %s", a.kind, a.child, a.seconds or 0, a.error)
                    break  # the rest of this change waits for the next decision (and the backoff)
                log.info("planner: %s %s done in %.1fs", a.kind, a.child, a.seconds or 0)
        finally:
            st.pending = None

    # --- endpoints -----------------------------------------------------------------------------------
    async def status(self, req: Any, headers: Mapping[str, str]) -> PlannerStatus:
        self.views = await self._views()  # as things are now, not as at the last decision
        engines = sum(v.current * self.planner.pools[n].limits.engines_per_replica for n, v in self.views.items())
        cfg = self.config
        return PlannerStatus(instance=self.instance, mode=cfg.mode, no_op=cfg.no_op,
                             interval=cfg.effective_interval(), ttft_target_ms=cfg.ttft_target_ms,
                             itl_target_ms=cfg.itl_target_ms, budget=cfg.budget, engines=engines,
                             predictor=cfg.predictor, pools=self.planner.status(self.views),
                             last_decision=self.decisions[-1] if self.decisions else None,
                             wake_pending=dict(self.keeper.pending), wakes=list(self.keeper.recent))

    async def recent(self, req: DecisionsRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        n = max(0, min(req.limit, KEEP_DECISIONS))
        return {"decisions": list(self.decisions)[-n:] if n else []}

    async def profile(self, req: ProfileRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        pools = self.planner.pools
        if req.pool is not None:
            st = pools.get(req.pool)
            if st is None:
                raise NotFound(f"no pool {req.pool!r} (pools: {', '.join(pools)})")
            if st.model is None:
                st.load_model()  # a profile made since the start is picked up when asked for
            if st.model is None:
                raise NotFound(f"pool {req.pool}: no profile ({st.profile_error or 'none configured'})")
            return {"path": str(st.profile_path), "profile": msgspec.to_builtins(st.model.profile)}
        for st in pools.values():
            if st.model is None:
                st.load_model()
        return {"pools": {name: ({"path": str(st.profile_path), **profile_summary(st.model.profile)}
                                 if st.model is not None else
                                 {"path": str(st.profile_path), "error": st.profile_error or "not loaded"})
                          for name, st in pools.items()},
                "mode": self.config.mode, "at": time.time()}
