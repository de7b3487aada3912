"""The frontend in front of the real engine actor with the mocker engine (no scaffolding)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.frontend.actor import FrontendActor
from actors.frontend.responses import WORKER_HEADER
from actors.worker.engine_actor import EngineActor
from bus.context import BusContext
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.helpers import openai_client

MODEL = ModelConfig(name="tiny", path="tiny")
ARGS = {"speedup_ratio": "inf", "max_model_len": 512, "block_size": 16}


@pytest.fixture
async def stack(bus: BusContext, tiny_dir: str) -> AsyncIterator[tuple[FrontendActor, list[EngineActor]]]:
    pool = PoolConfig(engine="mocker")
    workers = []
    for i in range(2):
        w = EngineActor(bus.child(), pool_name="agg", pool=pool, model=MODEL, instance=f"m{i}",
                        engine_factory=lambda: MockerEngine(dict(ARGS), role="agg", served_model_name="tiny"),
                        load_interval=0.5)
        await w.start()
        workers.append(w)
    fe = FrontendActor(bus.child(), config=FrontendConfig(http="127.0.0.1:0"), model_config=MODEL)
    await fe.start()
    for _ in range(200):
        if len(fe.workers.ready_instances()) == 2 and fe.workers.models:
            break
        await asyncio.sleep(0.05)
    await fe.app.pipeline.preprocessors.get(fe.workers.models["tiny"])
    try:
        yield fe, workers
    finally:
        await fe.stop(1.0)
        for w in workers:
            await w.stop(1.0)


async def test_openai_client_against_mocker(stack: Any) -> None:
    fe, workers = stack
    c = openai_client(f"http://127.0.0.1:{fe.port}")
    seen = set()
    for _ in range(2):
        raw = await c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello " * 40}], max_tokens=6,
            extra_body={"ignore_eos": True})
        r = raw.parse()
        seen.add(raw.headers[WORKER_HEADER])
        assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 40
        assert r.choices[0].finish_reason == "length"
    assert seen == {"m0", "m1"}  # round robin over both
    # a repeated prompt hits the mocker's prefix cache: cached tokens are reported
    r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello " * 40}],
                                        max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    stream = await c.completions.create(model="tiny", prompt="abc " * 20, max_tokens=5, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [ch async for ch in stream]
    assert chunks[-1].usage.completion_tokens == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
