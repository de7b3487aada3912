"""The planner as its deployment's waker (actors.planner.actor + wake.PoolKeeper), without NATS: the
keeper's wakes and idle stops and the planner's own changes of a pool never run at once, and the
planner holds a pool while the keeper acts on it. Through the CLI: tests/e2e/test_planner_zero.py."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.instances.contract import WORKER_KIND, InstanceRecord
from actors.planner.actor import PlannerActor
from actors.planner.constraints import PoolLimits
from actors.planner.contract import Action, Demand, Observed, WakeOutcome
from actors.planner.metrics import PlannerMetrics
from actors.planner.planner import Planner, PoolState, PoolView
from actors.planner.wake import KeptPool, PoolKeeper
from config.topology import PlannerConfig


def rec(instance: str, pid: int) -> InstanceRecord:
    return InstanceRecord(instance=instance, kind=WORKER_KIND, role="agg", model="m", host="h", pid=pid, pool="agg")


def kid(i: int) -> dict[str, Any]:
    return {"id": f"worker-agg-{i}", "state": "running", "pid": 100 + i, "meta": {"pool": "agg"}}


class Ops:
    """The bus as the keeper and the planner's scaler see it: one root running pool ``agg``. Spawns
    and stops wait for their gate, so a test can look while one runs."""

    def __init__(self) -> None:
        self.recs: list[InstanceRecord] = []
        self.kids: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str]] = []
        self.outcomes: list[WakeOutcome] = []
        self.gate = asyncio.Event()
        self.gate.set()

    def records(self) -> list[InstanceRecord]:
        return list(self.recs)

    async def children(self, host: str) -> list[dict[str, Any]]:
        return list(self.kids)

    async def wake_up(self, instance: str, timeout: float) -> None:
        self.calls.append(("wake_up", instance))

    async def spawn(self, host: str, pool: str, replica: int, engine: str) -> Action:
        self.calls.append(("spawn", f"worker-{pool}-{replica}"))
        await self.gate.wait()
        self.kids.append(kid(replica))
        self.recs.append(rec(f"agg-{replica}", 100 + replica))
        return Action(kind="spawn", pool=pool, child=f"worker-{pool}-{replica}", host=host, outcome="ok")

    async def stop(self, host: str, pool: str, child: str) -> Action:
        self.calls.append(("stop", child))
        await self.gate.wait()
        gone = next(c for c in self.kids if c["id"] == child)
        self.kids.remove(gone)
        self.recs = [r for r in self.recs if r.pid != gone["pid"]]
        return Action(kind="stop", pool=pool, child=child, host=host, outcome="ok")

    async def publish(self, outcome: WakeOutcome) -> None:
        self.outcomes.append(outcome)


def planner_actor(ops: Ops) -> PlannerActor:
    """The actor's acting half only (``_change`` and the keeper), as ``__init__`` wires it."""
    a = PlannerActor.__new__(PlannerActor)
    st = PoolState(limits=PoolLimits("agg", "local", 0, None, 1, True), role="agg", engine="mocker")
    a.planner = Planner(PlannerConfig(enabled=True, mode="load", min_replicas=0), {"agg": st})
    a.metrics = PlannerMetrics()
    a.scaler = ops  # type: ignore[assignment]
    a._changes = {}
    a.keeper = PoolKeeper([KeptPool("agg", "agg", "local", "mocker", idle_stop=5.0)], ops, instance="planner-t",
                          model="m", poll=0.01, on_busy=a._keeper_busy)
    return a


async def until(pred: Any, what: str) -> None:
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def demand() -> Demand:
    return Demand(model="m", frontend="fe", held=4, wake_timeout=5.0)


async def test_a_demand_during_the_planners_stop_of_the_last_replica_waits_then_spawns() -> None:
    ops = Ops()
    ops.kids, ops.recs = [kid(0)], [rec("agg-0", 100)]
    a = planner_actor(ops)
    st = a.planner.pools["agg"]
    ops.gate.clear()
    change = asyncio.create_task(a._change("agg", [Action(kind="stop", pool="agg", child="worker-agg-0",
                                                          host="local")]))
    await until(lambda: ops.calls == [("stop", "worker-agg-0")], "the planner's stop started")
    assert st.pending == "stop worker-agg-0"
    assert not a.keeper.idle("agg-0", 60.0)  # no idle stop starts beside the planner's stop
    # the worker has left the registry (it drains): the frontend holds requests and asks for a wake
    ops.recs = []
    assert a.keeper.demand(demand()) == ["agg"]
    await asyncio.sleep(0.05)
    assert ops.calls == [("stop", "worker-agg-0")] and a.keeper.pending == {}  # the wake waits
    ops.gate.set()
    await change
    await until(lambda: ops.outcomes, "the wake's outcome")
    assert ops.calls == [("stop", "worker-agg-0"), ("spawn", "worker-agg-0")]
    assert [(o.action, o.outcome, o.target) for o in ops.outcomes] == [("spawn", "ok", "worker-agg-0")]
    assert st.pending is None and a.keeper.pending == {}


async def test_the_planner_holds_a_pool_the_keeper_acts_on_and_drops_a_stale_change() -> None:
    ops = Ops()
    a = planner_actor(ops)
    st = a.planner.pools["agg"]
    ops.gate.clear()
    a.keeper.demand(demand())
    await until(lambda: ops.calls == [("spawn", "worker-agg-0")], "the keeper's spawn started")
    assert st.pending == "wake (waker)"
    view = {"agg": PoolView("agg", "agg", "local", "mocker")}
    d = a.planner.decide(view, Observed(windows=1, held=4), {}, now=0.0)
    assert d.actions == [] and d.pools[0].constraint == "change in progress: wake (waker)"
    # a change decided just before the keeper started is dropped: its counts are stale
    await a._change("agg", [Action(kind="spawn", pool="agg", child="worker-agg-0", host="local")])
    assert ops.calls == [("spawn", "worker-agg-0")]
    assert st.pending == "wake (waker)"  # the keeper's note stays
    ops.gate.set()
    await until(lambda: ops.outcomes, "the spawn's outcome")
    assert st.pending is None and [c["id"] for c in ops.kids] == ["worker-agg-0"]
    await a.keeper.close()
