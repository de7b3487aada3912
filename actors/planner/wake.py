"""Cold pools (logic only, no NATS): wake a pool when a frontend holds requests for it, and remove
replicas that stay idle. The transport is ``waker.WakerActor`` (a root without a planner) or the
planner actor, which keeps every pool itself so that a wake and its own changes never race.

- **Demand** (``Demand`` from a frontend, once per cold period): each kept pool without a ready
  worker gets one wake at a time. A sleeping replica (its record says "sleeping") is woken with the
  worker's ``wake_up`` verb. A pool with no replica at all gets one from its root's ``spawn``
  (the lowest free index; the root answers once the worker is ready, or with the start error). A
  pool whose replicas are there but not serving (one starting, one still being removed by an idle
  stop) is looked at again every ``poll`` seconds until one serves, none is left (then it spawns),
  or the demand's ``wake_timeout`` has passed.
- **Idle stop** (``pools.<p>.sleep.idle_stop``): a worker's load report carries its idle seconds
  (no request in flight, none started or ended; health probes do not count). Past the pool's
  ``idle_stop`` the replica is stopped and removed through its root (deregister, grace, drain:
  what reached it still finishes). The pool can reach zero replicas; the next demand spawns one.
- Every action ends in a ``WakeOutcome``, published for the frontends (a failed wake ends their
  held requests with the error) and kept for the status verb.

A stop and a wake of one pool never run at once: a demand that arrives while an idle stop runs
waits for it, then finds the pool empty and spawns.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from actors.instances.contract import InstanceRecord
from actors.planner.contract import Action, Demand, WakeOutcome
from bus.errors import ActorError
from bus.tasks import cancel_and_wait
from config.topology import PoolConfig
from config.workers import MAX_REPLICA, worker_child_id

log = logging.getLogger(__name__)

KEEP_OUTCOMES = 64


@dataclass(frozen=True)
class KeptPool:
    """A pool a keeper wakes and stops: its root (``host``: the supervisor subject's host token)."""

    name: str
    role: str
    host: str
    engine: str
    idle_stop: float | None = None

    @classmethod
    def of(cls, name: str, pool: PoolConfig, host: str) -> KeptPool:
        return cls(name=name, role=pool.role, host=host, engine=pool.engine, idle_stop=pool.sleep.idle_stop)


class WakeOps(Protocol):
    """What a keeper needs from the bus (``waker.BusWakeOps``)."""

    def records(self) -> Iterable[InstanceRecord]: ...  # the registry's instance records now

    async def children(self, host: str) -> list[dict[str, Any]]: ...  # the root's children views

    async def wake_up(self, instance: str, timeout: float) -> None: ...  # raises ActorError

    async def spawn(self, host: str, pool: str, replica: int, engine: str) -> Action: ...

    async def stop(self, host: str, pool: str, child: str) -> Action: ...

    async def publish(self, outcome: WakeOutcome) -> None: ...


def pool_of(child: dict[str, Any]) -> str | None:
    return (child.get("meta") or {}).get("pool")


class PoolKeeper:
    def __init__(self, pools: Iterable[KeptPool], ops: WakeOps, *, instance: str, model: str | None = None,
                 poll: float = 0.5, on_busy: Callable[[str, str | None], None] | None = None) -> None:
        """``on_busy(pool, what)``: called when an action on ``pool`` starts (``what``) and ends
        (None); the planner holds its own changes of that pool meanwhile."""
        self.pools = {p.name: p for p in pools}
        self.ops = ops
        self.instance = instance
        self.model = model
        self.poll = poll
        self.on_busy = on_busy
        self.pending: dict[str, str] = {}  # pool -> the action running for it
        self.recent: collections.deque[WakeOutcome] = collections.deque(maxlen=KEEP_OUTCOMES)
        self._locks = {name: asyncio.Lock() for name in self.pools}
        self._waking: set[str] = set()
        self._stopping: set[str] = set()  # instances an idle stop was started for
        # instances an idle stop removed: their records may still read "ready" until the watch
        # sees them go, and a wake must not take them for a server
        self._removed: collections.deque[str] = collections.deque(maxlen=256)
        self._tasks: set[asyncio.Task[None]] = set()

    def lock(self, pool: str) -> asyncio.Lock:
        """What every action on ``pool`` holds. A host that changes the pool itself (the planner's
        spawns and stops) holds it too: a wake then waits for it, an idle stop is skipped."""
        return self._locks[pool]

    # --- inputs --------------------------------------------------------------------------------------
    def demand(self, d: Demand) -> list[str]:
        """Start a wake of every kept pool that has no ready worker (one at a time per pool); the
        pools a wake was started for."""
        if self.model is not None and d.model != self.model:
            log.debug("demand for %s ignored: this deployment serves %s", d.model, self.model)
            return []
        ready = {r.pool for r in self.ops.records() if self._serves(r)}
        started = []
        for name in self.pools:
            if name in ready or name in self._waking:
                continue
            self._waking.add(name)
            self._spawn_task(self._wake(self.pools[name], d), f"wake:{name}")
            started.append(name)
        if started:
            log.info("demand for %s from %s (%d held): waking %s", d.model, d.frontend, d.held, ", ".join(started))
        return started

    def idle(self, instance: str, idle_s: float | None) -> bool:
        """A load report: True when it started an idle stop of ``instance``."""
        if idle_s is None or instance in self._stopping:
            return False
        rec = next((r for r in self.ops.records() if r.instance == instance and r.is_worker), None)
        if rec is None or rec.pool not in self.pools:
            return False
        pool = self.pools[rec.pool]
        if pool.idle_stop is None or idle_s < pool.idle_stop or self._locks[pool.name].locked():
            return False
        self._stopping.add(instance)
        self._spawn_task(self._stop_idle(pool, rec, idle_s), f"idle-stop:{instance}")
        return True

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        self._tasks.clear()

    def _serves(self, r: InstanceRecord) -> bool:
        """A ready worker that no idle stop is removing or has removed."""
        return (r.is_worker and r.status == "ready" and r.instance not in self._stopping
                and r.instance not in self._removed)

    # --- actions -------------------------------------------------------------------------------------
    def _spawn_task(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _busy(self, pool: str, what: str | None) -> None:
        if what is None:
            self.pending.pop(pool, None)
        else:
            self.pending[pool] = what
        if self.on_busy is not None:
            self.on_busy(pool, what)

    async def _wake(self, pool: KeptPool, d: Demand) -> None:
        t0 = time.monotonic()
        deadline = t0 + d.wake_timeout
        try:
            async with self._locks[pool.name]:
                self._busy(pool.name, "wake")
                try:
                    outcome = await self._bring_up(pool, d, t0, deadline)
                finally:
                    self._busy(pool.name, None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not leave the pool marked as waking forever
            log.exception("wake of pool %s failed", pool.name)
            outcome = self._outcome(pool, "wake", "failed", t0, error=f"internal error: {e}")
        finally:
            self._waking.discard(pool.name)
        if outcome is not None:
            await self._report(outcome)

    async def _bring_up(self, pool: KeptPool, d: Demand, t0: float, deadline: float) -> WakeOutcome | None:
        """Wake or spawn one replica of ``pool``; None when it serves already (nothing done)."""
        last_states: list[str] = []
        while True:
            mine = [r for r in self.ops.records() if r.is_worker and r.pool == pool.name]
            if any(self._serves(r) for r in mine):
                return None
            sleeping = sorted((r for r in mine if r.status == "sleeping"), key=lambda r: r.instance)
            if sleeping:
                target = sleeping[0].instance
                log.info("waking %s (pool %s) for %s", target, pool.name, d.model)
                try:
                    await self.ops.wake_up(target, max(1.0, deadline - time.monotonic()))
                except ActorError as e:
                    return self._outcome(pool, "wake", "failed", t0, target=target, error=str(e))
                return self._outcome(pool, "wake", "ok", t0, target=target)
            try:
                kids = [c for c in await self.ops.children(pool.host) if pool_of(c) == pool.name]
            except ActorError as e:
                kids, last_states = None, [f"root {pool.host} did not answer: {e}"]  # type: ignore[assignment]
            if kids is not None:
                live = [c for c in kids if c.get("state") != "stopped"]
                if not live:
                    taken = {c["id"] for c in kids}
                    replica = next(i for i in range(MAX_REPLICA + 1) if worker_child_id(pool.name, i) not in taken)
                    log.info("pool %s has no replica: spawning %s for %s", pool.name,
                             worker_child_id(pool.name, replica), d.model)
                    done = await self.ops.spawn(pool.host, pool.name, replica, pool.engine)
                    return self._outcome(pool, "spawn", done.outcome, t0, target=done.child, error=done.error)
                last_states = [f"{c['id']} {c.get('state')}" for c in live]
            if time.monotonic() >= deadline:
                return self._outcome(pool, "wake", "failed", t0, error=(
                    f"no replica of pool {pool.name} served within {d.wake_timeout:g}s "
                    f"({', '.join(last_states) or 'no replica'})"))
            await asyncio.sleep(self.poll)

    async def _stop_idle(self, pool: KeptPool, rec: InstanceRecord, idle_s: float) -> None:
        t0 = time.monotonic()
        lock = self._locks[pool.name]
        try:
            if lock.locked():
                return  # a wake runs: the replica is wanted
            async with lock:
                self._busy(pool.name, f"idle stop of {rec.instance}")
                try:
                    outcome = await self._stop(pool, rec, idle_s, t0)
                finally:
                    self._busy(pool.name, None)
        finally:
            self._stopping.discard(rec.instance)
        if outcome is not None:
            await self._report(outcome)

    async def _stop(self, pool: KeptPool, rec: InstanceRecord, idle_s: float, t0: float) -> WakeOutcome | None:
        try:
            kids = await self.ops.children(pool.host)
        except ActorError as e:
            log.warning("idle stop of %s: root %s did not answer (%s); next report tries again",
                        rec.instance, pool.host, e)
            return None
        child = next((c for c in kids if pool_of(c) == pool.name and c.get("pid") == rec.pid
                      and c.get("state") == "running"), None)
        if child is None:
            log.debug("idle stop of %s: no running child of pool %s has pid %s", rec.instance, pool.name, rec.pid)
            return None
        log.info("%s idle for %.0fs (pool %s idle_stop %gs): stopping %s", rec.instance, idle_s, pool.name,
                 pool.idle_stop or 0, child["id"])
        done = await self.ops.stop(pool.host, pool.name, child["id"])
        if done.outcome == "ok":
            self._removed.append(rec.instance)
        return self._outcome(pool, "stop", done.outcome, t0, target=child["id"], error=done.error)

    def _outcome(self, pool: KeptPool, action: str, outcome: str, t0: float, *, target: str = "",
                 error: str | None = None) -> WakeOutcome:
        return WakeOutcome(pool=pool.name, action=action, outcome=outcome, model=self.model,  # type: ignore[arg-type]
                           target=target, host=pool.host, error=error,
                           seconds=round(time.monotonic() - t0, 3), by=self.instance, ts=time.time())

    async def _report(self, o: WakeOutcome) -> None:
        self.recent.append(o)
        if o.outcome == "ok":
            log.info("%s of %s (pool %s) done in %.2fs", o.action, o.target, o.pool, o.seconds)
        else:
            log.warning("%s of pool %s failed after %.2fs: %s", o.action, o.pool, o.seconds, o.error)
        try:
            await self.ops.publish(o)
        except Exception as e:  # noqa: BLE001 - the held requests then end by their timeout
            log.warning("wake outcome of pool %s not published: %s", o.pool, e)
