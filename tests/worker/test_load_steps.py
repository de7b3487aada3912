"""Load reports carry the engine's step samples (over a real nats-server, with the mocker): what the
load-mode planner fits step time on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import SamplingOptions, StepSample
from actors.worker.contract import GenerateChunk, GenerateRequest, LoadReport
from actors.worker.engine_actor import EngineActor
from actors.worker.metrics import load_reports
from bus.context import BusContext
from bus.stream import stream_request
from config.topology import ModelConfig, PoolConfig

MODEL = ModelConfig(name="mock-model", path="mock")


def actor_for(bus: BusContext, instance: str, **args: Any) -> EngineActor:
    eargs = {"speedup_ratio": 100, "max_model_len": 512, "block_size": 16, **args}
    return EngineActor(bus.child(), pool_name="p0", pool=PoolConfig(engine="mocker"), model=MODEL,
                       engine_factory=lambda: MockerEngine(dict(eargs), served_model_name=MODEL.name),
                       instance=instance, load_interval=0.1)


@pytest.fixture
async def reports(bus: BusContext) -> AsyncIterator[asyncio.Queue[LoadReport]]:
    """Every load report of the namespace, decoded."""
    q: asyncio.Queue[LoadReport] = asyncio.Queue()

    async def on(msg: Any) -> None:
        q.put_nowait(msgspec.msgpack.decode(msg.data, type=LoadReport))

    sub = await bus.nc.subscribe(bus.subjects.load_all(), cb=on)
    yield q
    await sub.unsubscribe()


async def generate(bus: BusContext, prompt: list[int], max_tokens: int) -> list[GenerateChunk]:
    req = GenerateRequest(token_ids=prompt, sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True))
    return [c async for c in stream_request(bus.nc, bus.subjects.generate("p0"), req, msgpack=True,
                                            chunk_type=GenerateChunk, stall_timeout=5)]


async def steps_until(q: asyncio.Queue[LoadReport], instance: str, decodes: int) -> list[StepSample]:
    """The steps the instance's reports carry until ``decodes`` decode steps were seen."""
    steps: list[StepSample] = []
    async with asyncio.timeout(10):
        while sum(s.decode_requests for s in steps) < decodes:
            rep = await q.get()
            if rep.instance == instance:
                assert all(s.dp_rank == rep.dp_rank for s in rep.steps)  # each rank its own
                steps += rep.steps
    return steps


async def test_load_reports_carry_the_steps_since_the_last(bus: BusContext,
                                                           reports: asyncio.Queue[LoadReport]) -> None:
    a = actor_for(bus, "ws1")
    await a.start()
    try:
        await generate(bus, list(range(1, 40)), max_tokens=6)
        steps = await steps_until(reports, "ws1", decodes=5)
        # the engine actor's readiness probe (one prompt token, one output token) ran first
        assert [(s.prefill_tokens, s.decode_requests) for s in steps] == [(1, 0), (39, 0)] + [(0, 1)] * 5
        steps = steps[1:]
        assert all(s.kv_tokens in (48, 64) and s.elapsed_ms > 0 for s in steps)  # 3 or 4 blocks of 16
        # idle: the reports go on, with no steps (each step was reported once)
        for _ in range(3):
            async with asyncio.timeout(5):
                while (rep := await reports.get()).instance != "ws1":
                    pass
            assert rep.steps == []
    finally:
        await a.stop(2.0)


async def test_each_rank_reports_its_own_steps(bus: BusContext, reports: asyncio.Queue[LoadReport]) -> None:
    a = actor_for(bus, "ws2", dp_size=2)
    await a.start()
    try:
        await asyncio.gather(generate(bus, list(range(1, 21)), 3), generate(bus, list(range(50, 62)), 3))
        steps = await steps_until(reports, "ws2", decodes=4)
        assert sorted(s.prefill_tokens for s in steps if s.prefill_tokens) == [1, 12, 20]  # probe, prompts
        assert {s.dp_rank for s in steps} == {0, 1}
    finally:
        await a.stop(2.0)


def test_load_reports_split_steps_by_rank() -> None:
    from actors.engines.protocol import EngineStats

    stats = [EngineStats(dp_rank=0), EngineStats(dp_rank=1)]
    steps = [StepSample(5, 0, 16, 1.0, 1), StepSample(0, 2, 32, 2.0, 0), StepSample(0, 1, 16, 1.5, 1)]
    r0, r1 = load_reports("w", stats, now=1.0, steps=steps)
    assert r0.steps == [steps[1]] and r1.steps == [steps[0], steps[2]]
    assert [r.steps for r in load_reports("w", stats, now=1.0)] == [[], []]
