"""A cold model: readiness tells it from a missing one (``Readiness.cold_pool``), and the gate
(``ColdGate``) holds its requests, sends one demand per cold period, lets them go when a worker
serves, and ends them with the reason when a wake fails or times out. The bus side runs against a
real deployment in tests/e2e/test_cold_start.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.frontend.cold import ColdGate, TooManyHeld, WakeFailed
from actors.frontend.discovery import WorkerSet
from actors.frontend.metrics import FrontendMetrics
from actors.frontend.readiness import PoolExpectation, Readiness, WakeState
from actors.instances.contract import InstanceRecord, ModelCard
from actors.planner.contract import Demand, WakeOutcome
from config.topology import ColdConfig

CARD = ModelCard(served_model_name="m", pool="agg", role="agg", model_path="/x", tokenizer_path="/x",
                 context_length=100, kv_block_size=16, total_kv_blocks=10)


def rec(instance: str, status: str = "ready", pid: int = 1) -> InstanceRecord:
    return InstanceRecord(instance=instance, kind="engine", role="agg", model="m", host="h", pid=pid,
                          pool="agg", generate_subject=f"ns.agg.generate.{instance}", status=status)


def kid(state: str = "running", pid: int = 1) -> dict[str, Any]:
    return {"id": "worker-agg-0", "state": state, "pid": pid, "meta": {"pool": "agg", "replica": 0}}


def workers() -> WorkerSet:
    ws = WorkerSet()
    ws.put_model("m.agg", CARD)
    return ws


# --- readiness -------------------------------------------------------------------------------------
def test_all_replicas_asleep_is_cold_and_200() -> None:
    ws = workers()
    ws.put_instance("agg-0", rec("agg-0", "sleeping"))
    ready, body = Readiness("m", [PoolExpectation("agg", "agg", 1)], decode_fallback=False).evaluate(
        ws, {"worker-agg-0": kid()}, views_complete=True)
    assert ready and body["status"] == "cold", body
    assert body["cold"] == {"model": "m", "pools": {"agg": "sleep"}, "waking": False}


def test_a_pool_at_zero_is_cold_only_once_every_root_answered() -> None:
    r = Readiness("m", [PoolExpectation("agg", "agg", 1)], decode_fallback=False)
    ready, body = r.evaluate(workers(), {}, views_complete=False)
    assert not ready and body["status"] == "starting"  # no view: nothing is known
    ready, body = r.evaluate(workers(), {}, views_complete=True)
    assert ready and body["status"] == "cold" and body["pools"]["agg"]["expected"] == 0, body
    assert body["pools"]["agg"]["missing"][0]["state"] == "zero"


def test_a_replica_stopped_on_purpose_is_not_cold() -> None:
    """An operator's stop (kept, not removed) or a checkpoint's finished snapshot: nothing a request
    should start again, so the pool is not cold, and the deployment is not ready."""
    r = Readiness("m", [PoolExpectation("agg", "agg", 1, idle_stop=True)], decode_fallback=False)
    ws = workers()
    ws.put_instance("agg-0", rec("agg-0"))
    assert r.evaluate(ws, {"worker-agg-0": kid()}, views_complete=True)[0]
    ws.delete_instance("agg-0")
    ready, body = r.evaluate(ws, {"worker-agg-0": kid("stopped")}, views_complete=True)
    assert not ready and body["status"] == "unhealthy" and "cold" not in body, body


def test_a_replica_that_is_restarting_is_not_cold() -> None:
    r = Readiness("m", [PoolExpectation("agg", "agg", 1)], decode_fallback=False)
    ws = workers()
    ws.put_instance("agg-0", rec("agg-0"))
    assert r.evaluate(ws, {"worker-agg-0": kid()}, views_complete=True)[0]
    ws.delete_instance("agg-0")
    ready, body = r.evaluate(ws, {"worker-agg-0": kid("restarting")}, views_complete=True)
    assert not ready and body["status"] == "unhealthy", body


def test_idle_stop_pool_whose_replica_left_is_cold_while_it_is_removed() -> None:
    """Its process still runs (draining) after leaving the registry: with idle stop on, that is the
    way to zero (and a replica starting with no record is the way back); without, a running replica
    with no record is a failure (its engine restarts). Before the first ready, it is a start."""
    for idle_stop, status in ((True, "cold"), (False, "unhealthy")):
        ws = workers()
        r = Readiness("m", [PoolExpectation("agg", "agg", 1, idle_stop=idle_stop)], decode_fallback=False)
        _ready, body = r.evaluate(ws, {"worker-agg-0": kid("starting")}, views_complete=True)
        assert body["status"] == "starting", body  # at start-up: not a wake
        ws.put_instance("agg-0", rec("agg-0"))
        assert r.evaluate(ws, {"worker-agg-0": kid("running")}, views_complete=True)[0]
        ws.delete_instance("agg-0")
        for state in ("running", "starting"):
            _ready, body = r.evaluate(ws, {"worker-agg-0": kid(state)}, views_complete=True)
            assert body["status"] == status, (state, body)
        _ready, body = r.evaluate(ws, {"worker-agg-0": kid("restarting")}, views_complete=True)
        assert body["status"] == "unhealthy", body  # a crash is not a cold pool


def test_a_failed_wake_is_unhealthy_with_its_reason_and_a_wake_in_progress_is_cold() -> None:
    state = WakeState()
    r = Readiness("m", [PoolExpectation("agg", "agg", 1)], decode_fallback=False, wake=lambda _m: state)
    kids = {"worker-agg-0": kid("starting")}  # a spawn in progress
    assert r.evaluate(workers(), kids, views_complete=True)[1]["status"] == "starting"
    state = WakeState(waking=True)
    ready, body = r.evaluate(workers(), kids, views_complete=True)
    assert ready and body["status"] == "cold" and body["cold"]["waking"], body
    state = WakeState(failure="engine failed to start: boom")
    ready, body = r.evaluate(workers(), kids, views_complete=True)
    assert not ready and body["status"] == "unhealthy" and body["wake_error"] == "engine failed to start: boom"


# --- the gate --------------------------------------------------------------------------------------
class Bus:
    def __init__(self) -> None:
        self.demands: list[Demand] = []
        self.cold: str | None = "sleep"

    async def is_cold(self, _model: str) -> str | None:
        return self.cold

    async def send(self, d: Demand) -> None:
        self.demands.append(d)


def gate(ws: WorkerSet, bus: Bus, **cfg: Any) -> ColdGate:
    return ColdGate(ws, ColdConfig(**{"wake_timeout": 2.0, "keepalive": 0.05, **cfg}), frontend="f",
                    is_cold=bus.is_cold, send=bus.send, metrics=FrontendMetrics())


async def test_held_requests_go_on_when_a_worker_serves_and_one_demand_is_sent() -> None:
    ws, bus = workers(), Bus()
    g = gate(ws, bus)
    beats: list[int] = []

    async def keepalive() -> None:
        beats.append(1)

    held = [asyncio.create_task(g.hold("m", keepalive if i == 0 else None)) for i in range(5)]
    await asyncio.sleep(0.2)
    assert not any(t.done() for t in held)
    assert len(bus.demands) == 1 and bus.demands[0].model == "m" and bus.demands[0].wake_timeout == 2.0
    assert beats  # the stream got keep-alives while it waited
    ws.put_instance("agg-0", rec("agg-0"))  # woken: the registry shows it ready
    assert await asyncio.gather(*held) == [True] * 5
    assert not g.periods
    text = g.metrics.render().decode()
    assert 'vllm_actors_frontend_wake_seconds_count{cold="sleep",model="m"} 1.0' in text
    assert 'vllm_actors_frontend_held_requests_ended_total{model="m",outcome="served"} 5.0' in text


async def test_a_model_that_is_not_cold_is_not_held() -> None:
    bus = Bus()
    bus.cold = None
    assert await gate(workers(), bus).hold("m") is False
    assert not bus.demands


async def test_a_failed_wake_ends_every_held_request_and_is_answered_at_once_for_a_while() -> None:
    ws, bus = workers(), Bus()
    g = gate(ws, bus)
    held = [asyncio.create_task(g.hold("m")) for _ in range(3)]
    await asyncio.sleep(0.05)
    g.on_outcome(WakeOutcome(pool="agg", action="spawn", outcome="failed", model="m", error="exited with code 1"))
    for t in held:
        with pytest.raises(WakeFailed, match="could not start a replica of pool agg: exited with code 1"):
            await t
    with pytest.raises(WakeFailed) as e:
        await g.hold("m")
    assert e.value.code == 503 and int(e.value.retry_after) >= 1
    assert len(bus.demands) == 1  # no new wake per request while the failure is fresh


async def test_a_wake_that_takes_too_long_times_out_and_the_next_request_asks_again() -> None:
    ws, bus = workers(), Bus()
    g = gate(ws, bus, wake_timeout=0.2)
    with pytest.raises(WakeFailed, match="did not serve within 0.2s"):
        await g.hold("m")
    g.failures.clear()  # the failure hold ended
    task = asyncio.create_task(g.hold("m"))
    await asyncio.sleep(0.05)
    assert len(bus.demands) == 2
    ws.put_instance("agg-0", rec("agg-0"))
    assert await task


async def test_the_queue_per_model_is_bounded() -> None:
    ws, bus = workers(), Bus()
    g = gate(ws, bus, max_held=2)
    held = [asyncio.create_task(g.hold("m")) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(TooManyHeld):
        await g.hold("m")
    ws.put_instance("agg-0", rec("agg-0"))
    await asyncio.gather(*held)


async def test_outcomes_of_stops_and_successes_end_nothing() -> None:
    ws, bus = workers(), Bus()
    g = gate(ws, bus)
    task = asyncio.create_task(g.hold("m"))
    await asyncio.sleep(0.05)
    g.on_outcome(WakeOutcome(pool="agg", action="stop", outcome="failed", model="m"))
    g.on_outcome(WakeOutcome(pool="agg", action="wake", outcome="ok", model="m"))
    await asyncio.sleep(0.05)
    assert not task.done()
    ws.put_instance("agg-0", rec("agg-0"))
    assert await task
