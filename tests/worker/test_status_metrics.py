"""Status HTTP server (readiness gate) and the metrics exposition (ours + multiprocess vLLM-style)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.worker.metrics import WorkerMetrics, engine_metrics
from actors.worker.serving import EngineService
from actors.worker.sleep import SleepController
from actors.worker.status_http import StatusServer
from config.topology import ModelConfig, PoolConfig, SleepConfig


async def test_health_is_503_until_ready_then_200() -> None:
    state = {"ready": False}

    async def ready() -> tuple[bool, dict[str, Any]]:
        return state["ready"], {"engine": "healthy" if state["ready"] else "starting"}

    m = WorkerMetrics("i", "m")
    srv = StatusServer(0, ready, m.render, host="127.0.0.1", endpoints=lambda: ["ns.agg.generate"])
    await srv.start()
    try:
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{srv.port}"
            async with http.get(f"{base}/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "notready"
            async with http.get(f"{base}/live") as r:
                assert r.status == 200
            state["ready"] = True
            async with http.get(f"{base}/health") as r:
                body = await r.json()
                assert r.status == 200 and body["status"] == "healthy"
                assert body["endpoints"] == ["ns.agg.generate"] and body["uptime"] >= 0
            with m.track("generate"):
                pass
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                assert 'vllm_actors_worker_requests_total{endpoint="generate",model="m",status="ok",worker_id="i"} 1.0' in text
    finally:
        await srv.stop()


async def test_failing_ready_check_is_503_not_500() -> None:
    async def boom() -> tuple[bool, dict[str, Any]]:
        raise RuntimeError("nats down")

    srv = StatusServer(0, boom, WorkerMetrics("i", "m").render, host="127.0.0.1")
    await srv.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{srv.port}/health") as r:
            assert r.status == 503 and "nats down" in (await r.json())["message"]
    finally:
        await srv.stop()


def test_engine_metrics_multiprocess_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a value written by "another process" in multiprocess mode shows up in our exposition
    from prometheus_client import CollectorRegistry, Counter, values

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    values.ValueClass = values.get_value_class()
    try:
        c = Counter("vllm_test_requests", "test", registry=CollectorRegistry())
        c.inc(3)
        assert b"vllm_test_requests_total 3.0" in engine_metrics()
    finally:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
        values.ValueClass = values.get_value_class()


async def test_idle_sleep_deepens_to_level_2() -> None:
    pool = PoolConfig(engine="mocker")
    svc = EngineService(lambda: MockerEngine({"speedup_ratio": "inf"}), pool,
                        model=ModelConfig(name="m", path="mock"), metrics=WorkerMetrics("i2", "m"))
    await svc.start()
    levels: list[int] = []
    eng = svc.engine
    orig = eng.sleep

    async def spy(level: int = 1) -> None:
        levels.append(level)
        await orig(level)

    eng.sleep = spy  # type: ignore[method-assign]
    noop = asyncio.sleep
    sc = SleepController(svc, register=lambda: noop(0), deregister=lambda: noop(0),
                         config=SleepConfig(idle_timeout=0.2, level=1, deeper_after=0.2))
    sc.start_idle_watch()
    try:
        for _ in range(100):
            if sc.level == 2:
                break
            await asyncio.sleep(0.05)
        assert levels == [1, 2] and sc.asleep and sc.level == 2
        assert (await sc.wake_up()).status == "ok" and not await eng.is_sleeping()
    finally:
        await sc.stop_idle_watch()
        await svc.shutdown()
