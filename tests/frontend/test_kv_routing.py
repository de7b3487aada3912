"""The frontend's ``kv`` policy end to end: mocker engine actors + their KV publishers on NATS, the
frontend's in-process index fed by the events, routing decisions visible in x-worker-instance-id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI

from actors.base import Actor
from actors.engines.mocker import MockerEngine
from actors.frontend.actor import FrontendActor
from actors.frontend.app import WORKER_HEADER
from actors.kv.publisher import KvPublisherActor
from actors.worker.engine_actor import EngineActor
from bus.context import BusContext
from supervisors.topology import FrontendConfig, ModelConfig, PoolConfig

MODEL = ModelConfig(name="tiny", path="tiny")
ARGS = {"speedup_ratio": "inf", "max_model_len": 1024, "block_size": 16}


@pytest.fixture
async def kv_stack(bus: BusContext, tiny_dir: str) -> AsyncIterator[tuple[FrontendActor, list[Actor]]]:
    pool = PoolConfig(engine="mocker")
    actors: list[Actor] = []
    for i in range(3):
        w = EngineActor(bus.child(), pool_name="agg", pool=pool, model=MODEL, instance=f"kv{i}",
                        engine_factory=lambda: MockerEngine(dict(ARGS), role="agg", served_model_name="tiny"),
                        load_interval=0.2)
        await w.start()
        pub = KvPublisherActor(bus.child(), f"kv{i}", "agg", "tiny", 16, w.service.engine.kv_event_sources())
        await pub.start()
        actors += [w, pub]
    fe = FrontendActor(bus.child(), config=FrontendConfig(http="127.0.0.1:0", router="kv"), model_config=MODEL)
    await fe.start()
    for _ in range(200):
        policy = fe._router
        if len(fe.workers.ready_instances()) == 3 and fe.workers.models and getattr(policy, "feed", None):
            break
        await asyncio.sleep(0.05)
    await fe.app._preprocessor(fe.workers.models["tiny"])
    try:
        yield fe, actors
    finally:
        await fe.stop(1.0)
        for a in reversed(actors):
            await a.stop(1.0)


async def test_progressive_prefix_stays_on_one_worker(kv_stack: Any) -> None:
    fe, _ = kv_stack
    policy = fe._router
    assert policy.name == "kv" and policy.router is not None
    c = AsyncOpenAI(base_url=f"http://127.0.0.1:{fe.port}/v1", api_key="none", max_retries=0)
    words = " ".join(f"w{i}" for i in range(400))
    served = []
    for turn in range(4):
        # each turn extends the previous conversation (a chat session growing block by block)
        content = words[: 400 + 120 * turn]
        raw = await c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2,
            extra_body={"ignore_eos": True})
        served.append(raw.headers[WORKER_HEADER])
        await asyncio.sleep(0.3)  # the stored blocks reach the frontend's index as KV events
    assert len(set(served)) == 1, served
    stats = policy.router.stats()
    assert stats["index"]["blocks"] > 0 if "blocks" in stats["index"] else stats["index"]
    # the later turns found their prefix cached on that worker: the engine reports cached tokens
    r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words[:760]}],
                                        max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


async def test_unrelated_prompts_spread(kv_stack: Any) -> None:
    fe, _ = kv_stack
    c = AsyncOpenAI(base_url=f"http://127.0.0.1:{fe.port}/v1", api_key="none", max_retries=0)

    async def one(i: int) -> str:
        raw = await c.completions.with_raw_response.create(
            model="tiny", prompt=" ".join(f"topic{i}-{j}" for j in range(60)), max_tokens=64,
            extra_body={"ignore_eos": True})
        return raw.headers[WORKER_HEADER]

    # concurrent requests with no shared prefix: booked decode load spreads them over the workers
    served = await asyncio.gather(*(one(i) for i in range(6)))
    assert len(set(served)) >= 2, served


async def test_router_metrics_on_frontend_metrics(kv_stack: Any) -> None:
    fe, _ = kv_stack
    c = AsyncOpenAI(base_url=f"http://127.0.0.1:{fe.port}/v1", api_key="none", max_retries=0)
    await c.completions.create(model="tiny", prompt="metrics " * 80, max_tokens=1)
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{fe.port}/metrics") as r:
        text = await r.text()
    assert "frontend_requests_total" in text
    assert "router_" in text and "hashing" in text  # the kv router's overhead histograms


async def test_approximate_mode_follows_own_decisions(bus: BusContext, tiny_dir: str) -> None:
    """No KV publishers at all (engines without events): the approx index still keeps a session on
    the worker it was first sent to."""
    pool = PoolConfig(engine="mocker")
    workers = []
    for i in range(3):
        w = EngineActor(bus.child(), pool_name="agg", pool=pool, model=MODEL, instance=f"ap{i}",
                        engine_factory=lambda: MockerEngine(dict(ARGS), role="agg", served_model_name="tiny"))
        await w.start()
        workers.append(w)
    fe = FrontendActor(bus.child(), config=FrontendConfig(http="127.0.0.1:0", router="kv", kv_events=False),
                       model_config=MODEL)
    await fe.start()
    try:
        for _ in range(200):
            if getattr(fe._router, "router", None) is not None and len(fe.workers.ready_instances()) == 3:
                break
            await asyncio.sleep(0.05)
        assert fe._router.router.mode == "approx"
        c = AsyncOpenAI(base_url=f"http://127.0.0.1:{fe.port}/v1", api_key="none", max_retries=0)
        words = " ".join(f"s{i}" for i in range(300))
        served = set()
        for turn in range(3):
            raw = await c.completions.with_raw_response.create(model="tiny", prompt=words[: 600 + 200 * turn],
                                                                max_tokens=1)
            served.add(raw.headers[WORKER_HEADER])
        assert len(served) == 1
    finally:
        await fe.stop(1.0)
        for w in workers:
            await w.stop(1.0)


async def test_disaggregated_session_prefills_on_one_prefill_worker(bus: BusContext, tiny_dir: str) -> None:
    """kv routing with prefill and decode pools: every prefill of a growing session goes to the prefill
    worker that holds its prefix, which is never one of the decode workers."""
    from actors.frontend.app import PREFILL_HEADER

    actors: list[Actor] = []
    for role, n in (("prefill", 3), ("decode", 2)):
        for i in range(n):
            inst = f"{role}{i}"
            w = EngineActor(bus.child(), pool_name=role, pool=PoolConfig(role=role, engine="mocker"), model=MODEL,
                            instance=inst, load_interval=0.2,
                            engine_factory=lambda role=role: MockerEngine(dict(ARGS), role=role,
                                                                          served_model_name="tiny"))
            await w.start()
            actors.append(w)
            if role == "prefill":  # decode workers publish no KV events
                pub = KvPublisherActor(bus.child(), inst, role, "tiny", 16, w.service.engine.kv_event_sources())
                await pub.start()
                actors.append(pub)
    fe = FrontendActor(bus.child(), config=FrontendConfig(http="127.0.0.1:0", router="kv"), model_config=MODEL)
    await fe.start()
    try:
        for _ in range(200):
            if len(fe.workers.ready_instances()) == 5 and getattr(fe._router, "feed", None) is not None:
                break
            await asyncio.sleep(0.05)
        await fe.app._preprocessor(fe.workers.models["tiny"])
        c = AsyncOpenAI(base_url=f"http://127.0.0.1:{fe.port}/v1", api_key="none", max_retries=0)
        words = " ".join(f"d{i}" for i in range(400))
        prefills, decodes = [], []
        for turn in range(4):
            raw = await c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": words[: 400 + 120 * turn]}], max_tokens=2,
                extra_body={"ignore_eos": True})
            prefills.append(raw.headers[PREFILL_HEADER])
            decodes.append(raw.headers[WORKER_HEADER])
            await asyncio.sleep(0.3)  # the prefill worker's stored blocks reach the index
        assert len(set(prefills)) == 1 and prefills[0].startswith("prefill"), prefills
        assert all(d.startswith("decode") for d in decodes) and not set(prefills) & set(decodes)
    finally:
        await fe.stop(1.0)
        for a in reversed(actors):
            await a.stop(1.0)
