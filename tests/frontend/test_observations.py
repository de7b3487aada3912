"""The planner's observations at the frontend: the recorder (``Observations``) on its own, then the
windows a frontend publishes on ``<ns>.metrics.frontend.<instance>`` in front of mocker engines
(real nats-server, real engine actors)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import openai
import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.frontend.actor import FrontendActor
from actors.frontend.observations import Observations
from actors.planner.contract import ITL_BOUNDS_MS, TTFT_BOUNDS_MS, FrontendWindow
from actors.worker.engine_actor import EngineActor
from bus import codec
from bus.context import BusContext
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.helpers import openai_client

MODEL = ModelConfig(name="tiny", path="tiny")
ARGS = {"speedup_ratio": 100, "max_model_len": 512, "block_size": 16}


# --- the recorder ----------------------------------------------------------------------------------
def test_ttft_itl_per_token_and_sums() -> None:
    obs = Observations("fe1", "tiny", now=1000.0)
    r = obs.start(10.0)
    r.token(10.0, 0)  # a chunk without tokens says nothing
    r.token(10.05, 1)  # first token: TTFT 50 ms
    r.token(10.068, 1)  # one ITL of 18 ms
    r.token(10.122, 3)  # three tokens after 54 ms: three ITLs of 18 ms
    r.finish(prompt_tokens=40, generated_tokens=5, cached_tokens=32)
    w = obs.roll(1002.0)
    assert (w.instance, w.model, w.start, w.end) == ("fe1", "tiny", 1000.0, 1002.0)
    assert (w.requests, w.finished, w.failed) == (1, 1, 0)
    assert (w.isl_tokens, w.osl_tokens, w.cached_tokens) == (40, 5, 32)
    assert w.ttft.count == 1 and w.ttft.sum_ms == pytest.approx(50.0)
    assert w.itl.count == 4 and w.itl.sum_ms == pytest.approx(72.0)
    assert w.itl.counts[ITL_BOUNDS_MS.index(20)] == 4  # each 18 ms lands in the (15, 20] bucket
    assert w.ttft.bounds_ms == list(TTFT_BOUNDS_MS)


def test_first_chunk_of_several_tokens_is_one_ttft() -> None:
    obs = Observations(now=0.0)
    r = obs.start(0.0)
    r.token(0.2, 4)  # the first token came with three more: no gap to count for them
    r.token(0.3, 2)
    w = obs.roll(1.0)
    assert w.ttft.count == 1 and w.ttft.sum_ms == pytest.approx(200.0)
    assert w.itl.count == 2 and w.itl.sum_ms == pytest.approx(100.0)


def test_fail_and_closed_requests_ignore_the_rest() -> None:
    obs = Observations(now=0.0)
    a, b, c = obs.start(0.0), obs.start(0.0), obs.start(0.0)
    a.token(0.1, 1)
    a.fail()
    a.finish(10, 1, 0)  # already failed: not finished too
    a.token(0.2, 1)
    b.finish(5, 0, 0)
    b.fail()
    b.finish(5, 0, 0)  # counted once
    w = obs.roll(1.0)
    assert (w.requests, w.finished, w.failed, w.isl_tokens, w.osl_tokens) == (3, 1, 1, 5, 0)
    assert (w.ttft.count, w.itl.count) == (1, 0)
    c.token(0.5, 1)  # c is still running: counted where it happens
    assert obs.roll(2.0).ttft.count == 1


def test_windows_follow_each_other_and_empty_ones_are_zero() -> None:
    obs = Observations("fe", now=100.0)
    r = obs.start(0.0)  # starts in the first window ...
    r.token(0.01, 1)
    w1 = obs.roll(102.0)
    r.token(0.03, 1)  # ... ends in the second
    r.finish(7, 2, 0)
    w2 = obs.roll(104.0)
    w3 = obs.roll(106.0)
    assert (w1.start, w1.end, w2.start, w2.end, w3.start, w3.end) == (100, 102, 102, 104, 104, 106)
    assert (w1.requests, w1.finished, w1.ttft.count, w1.itl.count) == (1, 0, 1, 0)
    assert (w2.requests, w2.finished, w2.osl_tokens, w2.itl.count) == (0, 1, 2, 1)
    assert w3 == FrontendWindow(instance="fe", start=104.0, end=106.0)  # nothing: all zero
    assert w3.ttft.count == 0 and w3.itl.count == 0


def test_window_is_json_on_the_wire() -> None:
    obs = Observations("fe", "tiny", now=5.0)
    r = obs.start(0.0)
    r.token(0.02, 1)
    r.token(0.03, 1)
    r.finish(3, 2, 1)
    w = obs.roll(7.0)
    data = codec.encode(w)
    assert codec.decode(data, codec.headers_for(False), FrontendWindow) == w
    assert msgspec.json.decode(data)["ttft"]["counts"][TTFT_BOUNDS_MS.index(25)] == 1


# --- a frontend in front of mocker engines ------------------------------------------------------------
@contextlib.asynccontextmanager
async def stack(bus: BusContext, pools: dict[str, str], **frontend: Any) -> AsyncIterator[FrontendActor]:
    """Engine actors (pool name -> role) and a frontend publishing a window every 0.2 s."""
    workers = []
    fe = None
    try:
        for name, role in pools.items():
            w = EngineActor(bus.child(), pool_name=name, pool=PoolConfig(engine="mocker", role=role),  # type: ignore[arg-type]
                            model=MODEL, instance=f"{name}0",
                            engine_factory=lambda role=role: MockerEngine(dict(ARGS), role=role,
                                                                          served_model_name="tiny"),
                            load_interval=0.5)
            await w.start()
            workers.append(w)
        config = FrontendConfig(http="127.0.0.1:0", **{"observe_interval": 0.2, **frontend})
        fe = FrontendActor(bus.child(), config=config, model_config=MODEL)
        await fe.start()
        async with asyncio.timeout(10):
            while len(fe.workers.ready_instances()) < len(pools) or not fe.workers.models:
                await asyncio.sleep(0.05)
        await fe.app.pipeline.preprocessors.get(fe.workers.models["tiny"])
        yield fe
    finally:
        if fe is not None:
            await fe.stop(1.0)
        for w in workers:
            await w.stop(1.0)


@pytest.fixture
async def windows(bus: BusContext) -> AsyncIterator[list[FrontendWindow]]:
    """Every window published in the namespace, in order."""
    got: list[FrontendWindow] = []

    async def on(msg: Any) -> None:
        got.append(codec.decode(msg.data, msg.headers, FrontendWindow))

    sub = await bus.nc.subscribe(bus.subjects.metrics_frontend_all(), cb=on)
    yield got
    await sub.unsubscribe()


def total(ws: list[FrontendWindow]) -> FrontendWindow:
    out = FrontendWindow(instance=ws[0].instance, start=ws[0].start, end=ws[-1].end)
    for w in ws:
        out.add(w)
    return out


async def settled(windows: list[FrontendWindow], finished: int) -> FrontendWindow:
    """The windows' totals once ``finished`` requests were reported, and two windows after that (a
    late count would show up in them)."""
    async with asyncio.timeout(10):
        while not windows or total(windows).finished < finished:
            await asyncio.sleep(0.05)
        seen = len(windows)
        while len(windows) < seen + 2:
            await asyncio.sleep(0.05)
    return total(windows)


async def test_windows_count_engine_requests(bus: BusContext, windows: list[FrontendWindow]) -> None:
    async with stack(bus, {"agg": "agg"}) as fe:
        c = openai_client(f"http://127.0.0.1:{fe.port}")
        async with asyncio.timeout(10):  # empty windows arrive before any traffic
            while len(windows) < 2:
                await asyncio.sleep(0.05)
        assert windows[0].instance == fe.instance and windows[0].model == "tiny"
        assert all(w.requests == 0 and w.ttft.count == 0 for w in windows)
        prompt = "hello " * 40
        plain = [await c.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                            extra_body={"ignore_eos": True}) for _ in range(2)]
        stream = await c.completions.create(model="tiny", prompt="abc " * 20, max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 10
        t = await settled(windows, finished=4)
        # 2 plain requests and 2 choices of the streamed one: 4 engine requests
        assert (t.requests, t.finished, t.failed) == (4, 4, 0)
        plain_isl = sum(r.usage.prompt_tokens for r in plain)
        assert t.isl_tokens == plain_isl + 2 * usage.prompt_tokens  # usage counts a prompt once per n
        assert t.osl_tokens == 2 * 6 + 2 * 5
        assert t.ttft.count == 4  # one per engine request
        assert t.itl.count == 2 * 5 + 2 * 4  # one per token after each request's first
        cached_plain = sum(r.usage.prompt_tokens_details.cached_tokens for r in plain)
        assert cached_plain > 0  # the repeat hit the prefix cache
        assert cached_plain <= t.cached_tokens <= t.isl_tokens
        # windows follow each other without a gap
        assert all(a.end == b.start for a, b in zip(windows, windows[1:], strict=False))
    published = len(windows)
    await asyncio.sleep(0.5)
    assert len(windows) == published  # the publisher stopped with the actor


async def test_disaggregated_request_counts_once(bus: BusContext, windows: list[FrontendWindow]) -> None:
    async with stack(bus, {"prefill": "prefill", "decode": "decode"}) as fe:
        c = openai_client(f"http://127.0.0.1:{fe.port}")
        raw = await c.completions.with_raw_response.create(model="tiny", prompt="one two three " * 10,
                                                           max_tokens=4, extra_body={"ignore_eos": True})
        assert raw.headers.get("x-prefill-instance-id") == "prefill0"
        r = raw.parse()
        t = await settled(windows, finished=1)
        assert (t.requests, t.finished, t.failed) == (1, 1, 0)  # not once for prefill and again for decode
        assert (t.isl_tokens, t.osl_tokens) == (r.usage.prompt_tokens, 4)
        assert (t.ttft.count, t.itl.count) == (1, 3)


async def test_observe_interval_zero_publishes_nothing(bus: BusContext, windows: list[FrontendWindow]) -> None:
    async with stack(bus, {"agg": "agg"}, observe_interval=0) as fe:
        c = openai_client(f"http://127.0.0.1:{fe.port}")
        await c.completions.create(model="tiny", prompt="x y z", max_tokens=2)
        await asyncio.sleep(0.6)  # three windows of the other tests
    assert windows == []


# --- how a request ends, through the real pipeline (scripted workers: tests/frontend/conftest.py) -----
async def observed(deploy: Any, **worker: Any) -> Observations:
    await deploy.worker(**worker)
    await deploy.start_frontend(observe_interval=0, model_config=ModelConfig(
        name="tiny", path=deploy.tiny_dir, migration_limit=0))
    await deploy.wait_ready(1)
    return deploy.frontend.metrics.observations


async def test_stop_strings_finish_every_choice(deploy: Any) -> None:
    obs = await observed(deploy, delay=0.02)  # the stop string ends each choice before its flow
    c = openai_client(deploy.url)
    r = await c.completions.create(model="tiny", prompt=[1, 2], max_tokens=12, n=2, stop=[" seven"])
    assert [ch.finish_reason for ch in r.choices] == ["stop", "stop"]
    w = obs.roll(0.0)
    assert (w.requests, w.finished, w.failed) == (2, 2, 0)
    assert w.osl_tokens == r.usage.completion_tokens  # what arrived until the stop string
    assert w.isl_tokens == 2 * 2 and w.ttft.count == 2


async def test_a_failed_request_is_counted_failed(deploy: Any) -> None:
    obs = await observed(deploy, die_after=2)
    c = openai_client(deploy.url)
    with pytest.raises(openai.InternalServerError):  # migration limit 0: the death is the end
        await asyncio.wait_for(c.completions.create(model="tiny", prompt=[1, 2], max_tokens=10), 20)
    w = obs.roll(0.0)
    assert (w.requests, w.finished, w.failed) == (1, 0, 1)
    assert (w.ttft.count, w.itl.count, w.osl_tokens) == (1, 1, 0)  # two tokens came before the death


async def test_a_client_gone_is_neither_finished_nor_failed(deploy: Any) -> None:
    obs = await observed(deploy, delay=0.05)
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 500, "stream": True}
        resp = await http.post(deploy.url + "/v1/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()  # the client goes away mid-stream
    async with asyncio.timeout(5):
        while not deploy.workers[0].cancelled:
            await asyncio.sleep(0.02)
    w = obs.roll(0.0)
    assert (w.requests, w.finished, w.failed) == (1, 0, 0)
    assert w.ttft.count == 1
