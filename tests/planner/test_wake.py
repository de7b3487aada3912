"""PoolKeeper (actors.planner.wake): which replica a demand wakes or spawns, one action per pool at
a time, idle stops from load reports, and the outcomes, over recorded bus operations (the transport
runs against a real deployment in tests/e2e/test_cold_start.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.instances.contract import WORKER_KIND, InstanceRecord
from actors.planner.contract import Action, Demand, WakeOutcome
from actors.planner.wake import KeptPool, PoolKeeper
from bus.errors import Unavailable


def rec(instance: str, pool: str, status: str = "ready", pid: int = 1) -> InstanceRecord:
    return InstanceRecord(instance=instance, kind=WORKER_KIND, role="agg", model="m", host="h", pid=pid,
                          pool=pool, status=status)


class Ops:
    """Records what the keeper asks of the bus; answers from ``records`` and ``kids``."""

    def __init__(self) -> None:
        self.recs: list[InstanceRecord] = []
        self.kids: list[dict[str, Any]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.outcomes: list[WakeOutcome] = []
        self.wake_error: str | None = None
        self.spawn_gate = asyncio.Event()
        self.spawn_gate.set()
        self.stop_gate = asyncio.Event()
        self.stop_gate.set()

    def records(self) -> list[InstanceRecord]:
        return list(self.recs)

    async def children(self, host: str) -> list[dict[str, Any]]:
        self.calls.append(("children", host))
        return list(self.kids)

    async def wake_up(self, instance: str, timeout: float) -> None:
        self.calls.append(("wake_up", instance))
        if self.wake_error:
            raise Unavailable(self.wake_error)
        for i, r in enumerate(self.recs):
            if r.instance == instance:
                self.recs[i] = rec(instance, r.pool or "", "ready", r.pid)

    async def spawn(self, host: str, pool: str, replica: int, engine: str) -> Action:
        self.calls.append(("spawn", host, pool, replica))
        await self.spawn_gate.wait()
        child = f"worker-{pool}-{replica}"
        self.recs.append(rec(f"{pool}-{replica}-new", pool))
        return Action(kind="spawn", pool=pool, child=child, host=host, outcome="ok")

    async def stop(self, host: str, pool: str, child: str) -> Action:
        self.calls.append(("stop", host, pool, child))
        await self.stop_gate.wait()
        self.kids = [c for c in self.kids if c["id"] != child]
        return Action(kind="stop", pool=pool, child=child, host=host, outcome="ok")

    async def publish(self, outcome: WakeOutcome) -> None:
        self.outcomes.append(outcome)


def kid(pool: str, replica: int, state: str = "running", pid: int = 1) -> dict[str, Any]:
    return {"id": f"worker-{pool}-{replica}", "state": state, "pid": pid, "meta": {"pool": pool, "replica": replica}}


def demand(timeout: float = 5.0) -> Demand:
    return Demand(model="m", frontend="f", wake_timeout=timeout)


async def settle(keeper: PoolKeeper) -> None:
    for _ in range(100):
        if not keeper._tasks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"keeper tasks still running: {keeper._tasks}")


POOLS = [KeptPool("agg", "agg", "h", "mocker", idle_stop=3.0)]


async def test_a_demand_wakes_one_sleeping_replica_once() -> None:
    ops = Ops()
    ops.recs = [rec("a1", "agg", "sleeping"), rec("a0", "agg", "sleeping")]
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m")
    assert keeper.demand(demand()) == ["agg"]
    assert keeper.demand(demand()) == []  # a wake of the pool runs already
    await settle(keeper)
    assert [c for c in ops.calls if c[0] == "wake_up"] == [("wake_up", "a0")]
    assert [(o.action, o.outcome, o.target) for o in ops.outcomes] == [("wake", "ok", "a0")]
    assert keeper.demand(demand()) == []  # it serves now: nothing to do


async def test_a_demand_for_another_model_or_a_ready_pool_does_nothing() -> None:
    ops = Ops()
    ops.recs = [rec("a0", "agg")]
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m")
    assert keeper.demand(demand()) == []
    assert keeper.demand(Demand(model="other", frontend="f")) == []
    assert not ops.calls


async def test_a_pool_at_zero_spawns_the_lowest_free_replica() -> None:
    ops = Ops()
    ops.kids = [kid("agg", 0, state="stopped")]  # an operator's stopped (kept) child holds index 0
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m")
    keeper.demand(demand())
    await settle(keeper)
    assert ("spawn", "h", "agg", 1) in ops.calls
    assert [(o.action, o.outcome, o.target) for o in ops.outcomes] == [("spawn", "ok", "worker-agg-1")]


async def test_a_failed_wake_is_an_outcome_with_the_reason() -> None:
    ops = Ops()
    ops.recs = [rec("a0", "agg", "sleeping")]
    ops.wake_error = "engine wake_up failed: CUDA out of memory"
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m")
    keeper.demand(demand())
    await settle(keeper)
    (o,) = ops.outcomes
    assert o.outcome == "failed" and "CUDA out of memory" in (o.error or "") and o.model == "m"


async def test_replicas_that_do_not_serve_are_waited_for_until_the_timeout() -> None:
    ops = Ops()
    ops.kids = [kid("agg", 0, state="restarting")]
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m", poll=0.02)
    keeper.demand(demand(timeout=0.2))
    await asyncio.sleep(0.3)
    await settle(keeper)
    (o,) = ops.outcomes
    assert o.outcome == "failed" and "worker-agg-0 restarting" in (o.error or "")
    assert not [c for c in ops.calls if c[0] == "spawn"]  # a replica is there: none is added


async def test_idle_stop_removes_the_replica_past_idle_stop_only() -> None:
    ops = Ops()
    ops.recs = [rec("a0", "agg", pid=42)]
    ops.kids = [kid("agg", 0, pid=42)]
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m")
    assert not keeper.idle("a0", 2.9)
    assert not keeper.idle("a0", None)  # a request in flight
    assert keeper.idle("a0", 3.0)
    assert not keeper.idle("a0", 3.5)  # already being stopped
    await settle(keeper)
    assert ("stop", "h", "agg", "worker-agg-0") in ops.calls
    assert [(o.action, o.outcome) for o in ops.outcomes] == [("stop", "ok")]


async def test_a_demand_during_an_idle_stop_waits_for_it_then_spawns() -> None:
    """The stopped replica still reads "ready" until the registry drops it: the demand must not
    take it for a server, and the spawn must not race the stop."""
    ops = Ops()
    ops.recs = [rec("a0", "agg", pid=42)]
    ops.kids = [kid("agg", 0, pid=42)]
    ops.stop_gate.clear()
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m", poll=0.02)
    assert keeper.idle("a0", 10.0)
    await asyncio.sleep(0.05)
    assert keeper.demand(demand()) == ["agg"]
    await asyncio.sleep(0.05)
    assert not [c for c in ops.calls if c[0] == "spawn"]  # waits for the stop
    ops.stop_gate.set()
    await settle(keeper)
    assert [c[0] for c in ops.calls if c[0] in ("stop", "spawn")] == ["stop", "spawn"]
    assert [o.action for o in ops.outcomes] == ["stop", "spawn"]


async def test_no_idle_stop_while_a_wake_runs() -> None:
    ops = Ops()
    ops.spawn_gate.clear()
    keeper = PoolKeeper(POOLS, ops, instance="w", model="m")
    keeper.demand(demand())
    await asyncio.sleep(0.05)
    ops.kids = [kid("agg", 0, pid=7)]
    ops.recs = [rec("old", "agg", pid=7)]
    assert not keeper.idle("old", 100.0)
    ops.spawn_gate.set()
    await settle(keeper)


async def test_pools_without_idle_stop_are_never_stopped() -> None:
    ops = Ops()
    ops.recs = [rec("a0", "agg")]
    keeper = PoolKeeper([KeptPool("agg", "agg", "h", "mocker", idle_stop=None)], ops, instance="w")
    assert not keeper.idle("a0", 1e9)


async def test_busy_callback_brackets_each_action() -> None:
    ops = Ops()
    ops.recs = [rec("a0", "agg", "sleeping")]
    seen: list[tuple[str, str | None]] = []
    keeper = PoolKeeper(POOLS, ops, instance="w", on_busy=lambda p, w: seen.append((p, w)))
    keeper.demand(demand())
    await settle(keeper)
    assert seen == [("agg", "wake"), ("agg", None)] and keeper.pending == {}
