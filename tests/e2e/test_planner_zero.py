"""The SLA planner scales a pool 0 → N → 0 under a trace that starts and ends idle, as a user runs
it: ``python -m actors.supervisor topologies/mocker-zero.toml`` (load mode, min_replicas = 0,
decisions every 2 s), OpenAI traffic over HTTP, the planner and the root watched over NATS.

The planner is the deployment's waker: no waker actor runs, the frontend's demand is acted on by
the planner at once (a spawn, since the pool is at zero), and what it did is in its status.
Throughout, /v1/models lists the model and /health answers 200 (``cold`` while at zero).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats
import pytest

from tests.e2e.cold_client import Watcher, assert_complete, sixteen
from tests.e2e.conftest import Deployment, http_json, shutdown

INTERVAL = 2.0


async def nats_json(d: Deployment, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    nc = await nats.connect(d.bus_url)
    try:
        msg = await nc.request(subject, json.dumps(body or {}).encode(), timeout=10)
        return json.loads(msg.data)
    finally:
        await nc.close()


async def replicas(d: Deployment) -> list[str]:
    """The agg replicas the root runs (its children view, as ``nats req <ns>.supervisor.local.children``)."""
    view = await nats_json(d, f"{d.namespace}.supervisor.local.children")
    return [c["id"] for c in view["children"]
            if (c.get("meta") or {}).get("pool") == "agg" and c.get("state") != "stopped"]


async def until(d: Deployment, pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = await pred()
        if v:
            return v
        await asyncio.sleep(0.2)
    pytest.fail(f"{what}: not reached in {timeout}s:\n{d.output(4000)}")


@pytest.mark.slow
async def test_planner_scales_a_pool_from_zero_and_back(tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("planner_zero")
    d = Deployment("mocker-zero.toml", tmp, namespace=f"e2eplzero{time.monotonic_ns() % 10**9}",
                   sets=[f"planner.interval={INTERVAL}"])
    d.start()
    try:
        d.wait_ready({"agg": 1}, timeout=60)
        with Watcher(d) as w:
            # idle from the start: the planner takes the pool to zero
            await until(d, lambda: _empty(d), 30, "the idle pool at zero replicas")
            await until(d, lambda: _cold(d), 10, "/health: cold (zero)")
            decisions = (await nats_json(d, f"{d.namespace}.planner.decisions", {"limit": 50}))["decisions"]
            downs = [p for dec in decisions for p in dec["pools"] if p["current"] == 1 and p["target"] == 0]
            assert downs and "idle" in downs[-1]["reason"], decisions

            # requests for the cold model: held, the planner spawns a replica at once, all served
            t0 = time.monotonic()
            results = await sixteen(d)
            took = time.monotonic() - t0
            assert_complete(results)
            assert len(await replicas(d)) == 1  # the one the demand spawned; no decision grew it (below)
            assert took < 3 * INTERVAL + 10, took  # not a decision later: the demand is acted on at once

            async def spawned() -> dict[str, Any] | None:
                # the spawn's outcome is recorded when the root answers it (the whole worker up),
                # which can come after the engine registered and served the held requests
                status = await nats_json(d, f"{d.namespace}.planner.status")
                return status if any(o["action"] == "spawn" for o in status.get("wakes", [])) else None

            status = await until(d, spawned, 10, "the spawn's outcome in planner.status")
            spawns = [o for o in status["wakes"] if o["action"] == "spawn"]
            assert spawns and spawns[-1]["outcome"] == "ok", status
            assert spawns[-1]["by"].startswith("planner"), spawns

            # idle again: back to zero
            await until(d, lambda: _empty(d), 30, "the pool back at zero replicas")
            await until(d, lambda: _cold(d), 10, "/health: cold again")
            # the wait for the spawn is not load: no decision grew the pool for the latency it added
            # (the planner's TTFT starts after a hold)
            decisions = (await nats_json(d, f"{d.namespace}.planner.decisions", {"limit": 50}))["decisions"]
            grown = [p for dec in decisions for p in dec["pools"] if p["target"] > p["current"]]
            assert not grown, grown
        assert not w.bad, w.bad[:5]
        assert {"cold", "healthy"} <= w.statuses, w.statuses
        # the planner is the waker: no waker actor beside it (`nats micro ls` lists no "waker"), while
        # the planner's service answers the same ping
        assert await _micro_ping(d, "planner") and not await _micro_ping(d, "waker")
        log = d.output(200_000)
        assert "planner: stop worker-agg-0" in log and "pool agg has no replica: spawning worker-agg-0" in log
    finally:
        shutdown(d)
    assert "Traceback" not in d.output(200_000), d.output(200_000)


async def _micro_ping(d: Deployment, service: str) -> bool:
    """Whether a micro service of that name answers ``$SRV.PING.<name>`` (what ``nats micro ls`` asks)."""
    nc = await nats.connect(d.bus_url)
    try:
        await nc.request(f"$SRV.PING.{service}", b"", timeout=2)
        return True
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return False
    finally:
        await nc.close()


async def _empty(d: Deployment) -> bool:
    return await replicas(d) == []


async def _cold(d: Deployment) -> bool:
    code, body = http_json(f"{d.url}/health")
    return code == 200 and body.get("status") == "cold"
