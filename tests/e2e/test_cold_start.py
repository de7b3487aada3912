"""Scale to zero and back, as a user meets it: mocker deployments started with
``python -m actors.supervisor`` whose pools go cold on their own (``sleep.idle_timeout``,
``sleep.idle_stop``), then 16 concurrent requests through the official ``openai`` client.

What a client must see: the model listed in /v1/models throughout, /health 200 ("cold") while cold,
every held request served in full, the first token within the wake (or spawn) time + 1 s (+ 2 s
from zero), one demand per cold period on the bus, and a wake that cannot succeed ending the held
requests with 503 + Retry-After and the reason, within ``frontend.cold.wake_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cold_client import BusLog, Watcher, assert_complete, cold_state, sixteen, wake_seconds
from tests.e2e.conftest import Deployment, boot, http_text, post, shutdown

WAKE_TIMEOUT = 20.0

TOPOLOGY = """namespace = "dynamo"
[model]
name = "tiny"
path = "tiny"
[frontend]
http = "127.0.0.1:8000"
[frontend.cold]
wake_timeout = {wake_timeout}
keepalive = {keepalive}
[pools.agg]
role = "agg"
engine = "mocker"
replicas = 1
[pools.agg.sleep]
{sleep}
[pools.agg.engine_args]
block_size = 16
num_gpu_blocks = 4096
speedup_ratio = 0.0
{extra}
"""


def write_topology(path: Path, sleep: str, extra: str = "", keepalive: float = 10.0) -> None:
    path.write_text(TOPOLOGY.format(wake_timeout=WAKE_TIMEOUT, sleep=sleep, extra=extra, keepalive=keepalive))


@pytest.fixture(scope="module")
def asleep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Idle auto-sleep after 1 s at level 1, deepened to level 2 after 2 s more."""
    topo = tmp_path_factory.mktemp("cold-topology") / "sleep.toml"
    write_topology(topo, "idle_timeout = 1.0\nlevel = 1\ndeeper_after = 2.0")
    d = boot(tmp_path_factory, "cold_sleep", str(topo), ready={"agg": 1})
    yield d
    shutdown(d)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, Path]]:
    """Idle stop after 2 s: the pool goes to zero replicas. Held streams get a keep-alive every
    0.2 s, so the ones held through a spawn (about a second) get several."""
    topo = tmp_path_factory.mktemp("cold-topology") / "zero.toml"
    write_topology(topo, "idle_stop = 2.0", keepalive=0.2)
    d = boot(tmp_path_factory, "cold_zero", str(topo), ready={"agg": 1})
    yield d, topo
    shutdown(d)


@pytest.mark.slow
async def test_asleep_worker_is_woken_by_requests(asleep: Deployment) -> None:
    d = asleep
    async with BusLog(d) as bus:
        for level in (1, 2):
            d.wait_until(lambda: cold_state(d) == "sleep", 15, "the idle worker asleep (/health: cold)")
            if level == 2:
                time.sleep(2.5)  # deeper_after: the sleep deepens to level 2
                assert "sleep deepened to level 2" in d.output(200_000)
            _, body = d.health()
            assert body["pools"]["agg"]["missing"][0]["state"] == "sleeping", body
            before, seen = len(bus.demands), len(bus.outcomes)
            with Watcher(d) as w:
                results = await sixteen(d)
            assert_complete(results)
            assert not w.bad and w.polls, (w.bad, w.polls)
            wake = await bus.outcome("wake", since=seen)
            assert wake["outcome"] == "ok", bus.outcomes
            # the first token of every request within the wake time + 1 s
            worst = max(r["first"] for r in results)
            assert worst <= wake["seconds"] + 1.0, (worst, wake)
            assert len(bus.demands) - before == 1, bus.demands  # once per cold period, not per request
            assert bus.demands[-1]["model"] == "tiny"
    assert wake_seconds(d).get("sleep") == 2.0, http_text(f"{d.url}/metrics")[-3000:]


@pytest.mark.slow
async def test_pool_at_zero_is_started_by_requests(scaled: tuple[Deployment, Path]) -> None:
    d, _ = scaled
    async with BusLog(d) as bus:
        with Watcher(d) as w:
            d.wait_until(lambda: cold_state(d) == "zero", 20, "the idle pool at zero replicas (/health: cold)")
            await bus.until_no_replica()
            # published once the root answered the stop, which may reach us after the removal shows
            stop = await bus.outcome("stop")
            assert stop["outcome"] == "ok", bus.outcomes
            results = await sixteen(d)
            assert_complete(results)
            spawn = await bus.outcome("spawn")
            assert spawn["outcome"] == "ok", bus.outcomes
            # the first token within the engine's load time (the spawn, ready included) + 2 s
            worst = max(r["first"] for r in results)
            assert worst <= spawn["seconds"] + 2.0, (worst, spawn)
            assert len(bus.demands) == 1, bus.demands
            kids = await bus.children()
            assert [c["id"] for c in kids if (c.get("meta") or {}).get("pool") == "agg"] == ["worker-agg-0"], kids
            waker = await bus.waker()
            assert waker["pools"]["agg"]["idle_stop"] == 2.0 and waker["pending"] == {}, waker
            assert [(o["action"], o["outcome"]) for o in waker["recent"]][-2:] == [("stop", "ok"), ("spawn", "ok")]
        assert not w.bad and w.polls, (w.bad, w.polls)
        assert "cold" in w.statuses and "healthy" in w.statuses, w.statuses
    assert wake_seconds(d).get("zero") == 1.0


@pytest.mark.slow
async def test_a_wake_that_cannot_succeed_ends_held_requests_with_503(scaled: tuple[Deployment, Path]) -> None:
    """The pool's engine now fails to start (its topology says so); the held requests end with 503
    + Retry-After naming the reason, within the wake timeout, and /health says why."""
    d, topo = scaled
    d.wait_until(lambda: cold_state(d) == "zero", 20, "the idle pool at zero replicas")
    async with BusLog(d) as bus:
        await bus.until_no_replica()
    # what a spawned worker reads (the frontend keeps the keep-alive interval it started with)
    write_topology(topo, "idle_stop = 2.0", extra="die_at_start = true", keepalive=0.2)
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answers = await asyncio.gather(*(loop.run_in_executor(None, lambda b=b: post(
        f"{d.url}/v1/chat/completions", b, timeout=WAKE_TIMEOUT + 10))
        for b in (body, body, {**body, "stream": True}, {**body, "stream": True})))
    took = time.monotonic() - t0
    assert took <= WAKE_TIMEOUT + 1.0, took
    for code, headers, text in answers[:2]:
        assert code == 503, (code, text)
        assert int(headers["Retry-After"]) >= 1, headers
        msg = json.loads(text)["error"]["message"]
        assert "could not start a replica of pool agg" in msg and "die_at_start" in msg, msg
    for code, _headers, text in answers[2:]:
        # the streams had their 200 with the first keep-alive: the failure is their error event
        assert code == 200, (code, text)
        assert text.startswith(": waiting for the model to wake up\n\n"), text[:200]
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert err["code"] == 503 and "die_at_start" in err["message"], err
    code, health = d.health()
    assert code == 503 and health["status"] == "unhealthy" and "die_at_start" in health["wake_error"], health
    # the same answer at once while the failure is fresh: no new spawn per request
    code, headers, text = post(f"{d.url}/v1/chat/completions", body, timeout=5)
    assert code == 503 and "die_at_start" in text, (code, text)
    with contextlib.suppress(Exception):
        write_topology(topo, "idle_stop = 2.0", keepalive=0.2)
