"""The frontend's ``kv`` policy end to end: mocker engine actors + their KV publishers on NATS, the
frontend's in-process index fed by the events, routing decisions visible in x-worker-instance-id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI

from actors.base import Actor
from actors.engines.mocker.engine import MockerEngine
from actors.frontend.actor import FrontendActor
from actors.frontend.responses import WORKER_HEADER
from actors.worker.engine_actor import EngineActor
from actors.worker.kv_publisher import KvPublisherActor
from bus.context import BusContext
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.helpers import eventually, openai_client

MODEL = ModelConfig(name="tiny", path="tiny")
ARGS = {"speedup_ratio": "inf", "max_model_len": 1024, "block_size": 16}


def client(fe: FrontendActor) -> AsyncOpenAI:
    return openai_client(f"http://127.0.0.1:{fe.port}")


async def index_grew(fe: FrontendActor, before: int) -> int:
    """Wait until the frontend's index holds more blocks than ``before`` (a request's stored blocks
    have arrived as KV events; a fixed sleep can lose that race on a loaded machine); the count."""
    index = fe._router.router.index
    await eventually(lambda: index.stats()["blocks"] > before, timeout=30)
    return index.stats()["blocks"]


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
        if (len(fe.workers.ready_instances()) == 3 and fe.workers.models and policy.feed_started.is_set()
                and len(policy.feed.known_workers()) == 3):
            break
        await asyncio.sleep(0.05)
    await fe.app.pipeline.preprocessors.get(fe.workers.models["tiny"])
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
    c = client(fe)
    words = " ".join(f"w{i}" for i in range(400))
    served = []
    blocks = 0
    for turn in range(4):
        # each turn extends the previous conversation (a chat session growing block by block)
        content = words[: 400 + 120 * turn]
        raw = await c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2,
            extra_body={"ignore_eos": True})
        served.append(raw.headers[WORKER_HEADER])
        blocks = await index_grew(fe, blocks)  # this turn's blocks are in the index: the next finds them
    assert len(set(served)) == 1, served
    stats = policy.router.stats()
    assert stats["index"]["blocks"] > 0 if "blocks" in stats["index"] else stats["index"]
    # the later turns found their prefix cached on that worker: the engine reports cached tokens
    r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words[:760]}],
                                        max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


async def test_unrelated_prompts_spread(kv_stack: Any) -> None:
    fe, _ = kv_stack
    c = client(fe)

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
    c = client(fe)
    await c.completions.create(model="tiny", prompt="metrics " * 80, max_tokens=1)
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{fe.port}/metrics") as r:
        text = await r.text()
    assert "vllm_actors_frontend_requests_total" in text
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
        c = client(fe)
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
    from actors.frontend.responses import PREFILL_HEADER

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
        await fe.app.pipeline.preprocessors.get(fe.workers.models["tiny"])
        c = client(fe)
        words = " ".join(f"d{i}" for i in range(400))
        prefills, decodes = [], []
        blocks = 0
        for turn in range(4):
            raw = await c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": words[: 400 + 120 * turn]}], max_tokens=2,
                extra_body={"ignore_eos": True})
            prefills.append(raw.headers[PREFILL_HEADER])
            decodes.append(raw.headers[WORKER_HEADER])
            blocks = await index_grew(fe, blocks)  # the prefill worker's stored blocks are in the index
        assert len(set(prefills)) == 1 and prefills[0].startswith("prefill"), prefills
        assert all(d.startswith("decode") for d in decodes) and not set(prefills) & set(decodes)
    finally:
        await fe.stop(1.0)
        for a in reversed(actors):
            await a.stop(1.0)


async def _router_call(bus: BusContext, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    """Plain JSON without headers, as `nats req dynamo.router.<verb> '{}'` sends it."""
    import json

    msg = await bus.nc.request(bus.subjects.router(verb), json.dumps(body).encode(), timeout=3)
    assert msg.data, f"{verb} answered an error: {msg.headers}"
    return json.loads(msg.data)


async def _start_kv_worker(bus: BusContext, inst: str, *, publish: bool = True) -> list[Actor]:
    w = EngineActor(bus.child(), pool_name="agg", pool=PoolConfig(engine="mocker"), model=MODEL, instance=inst,
                    engine_factory=lambda: MockerEngine(dict(ARGS), role="agg", served_model_name="tiny"),
                    load_interval=0.2)
    await w.start()
    return [w, await _start_publisher(bus, w)] if publish else [w]


async def _start_publisher(bus: BusContext, w: EngineActor) -> KvPublisherActor:
    pub = KvPublisherActor(bus.child(), w.instance, "agg", "tiny", 16, w.service.engine.kv_event_sources())
    await pub.start()
    return pub


async def test_sessions_sent_as_soon_as_the_model_is_listed_stay_on_one_worker(bus: BusContext,
                                                                                tiny_dir: str) -> None:
    """No settling time, and no KV event before the sessions end (the publishers start late, as a
    lagging event path would look): only the booked decisions can keep each session in place."""
    import aiohttp

    fe = FrontendActor(bus.child(), config=FrontendConfig(http="127.0.0.1:0", router="kv"), model_config=MODEL)
    await fe.start()
    actors: list[Actor] = []
    try:
        for i in range(4):
            actors += await _start_kv_worker(bus, f"st{i}", publish=False)
        async with aiohttp.ClientSession() as s:
            for _ in range(400):
                async with s.get(f"http://127.0.0.1:{fe.port}/v1/models") as r:
                    if r.status == 200 and any(m["id"] == "tiny" for m in (await r.json())["data"]):
                        break
                await asyncio.sleep(0.01)
        policy = fe._router
        assert policy.router is not None  # built when the first worker registered, not later
        c = client(fe)
        sessions = [[1000 * (sess + 1) + j for j in range(16 * 8)] for sess in range(8)]
        placed: dict[int, list[str]] = {}
        for sess, base in enumerate(sessions):
            for turn in range(4):  # back to back: each prompt extends the previous one by a block
                raw = await c.completions.with_raw_response.create(
                    model="tiny", prompt=base[: 16 * (4 + turn)], max_tokens=2, extra_body={"ignore_eos": True})
                placed.setdefault(sess, []).append(raw.headers[WORKER_HEADER])
        assert all(len(set(ws)) == 1 for ws in placed.values()), placed
        assert len({ws[0] for ws in placed.values()}) == 4  # new prefixes still spread
        stats = await _router_call(bus, "index.stats", {})
        assert stats["ready"] and stats["block_size"] == 16 and stats["index"]["blocks"] == 0
        assert stats["predicted"]["blocks"] == 8 * 7
        # the events arrive at last: they confirm the predictions, and the sessions stay put
        for w in [a for a in actors if isinstance(a, EngineActor)]:
            actors.append(await _start_publisher(bus, w))
        for _ in range(200):
            stats = await _router_call(bus, "index.stats", {})
            if stats["predicted"]["blocks"] == 0:
                break
            await asyncio.sleep(0.05)
        assert stats["predicted"]["blocks"] == 0 and stats["index"]["blocks"] == 8 * 7
        for sess, base in enumerate(sessions):
            raw = await c.completions.with_raw_response.create(model="tiny", prompt=base[: 16 * 8], max_tokens=1)
            assert raw.headers[WORKER_HEADER] == placed[sess][0]
    finally:
        await fe.stop(1.0)
        for a in reversed(actors):
            await a.stop(1.0)


async def test_late_worker_is_bootstrapped_without_the_others_losing_blocks(bus: BusContext,
                                                                           kv_stack: Any) -> None:
    fe, actors = kv_stack
    c = client(fe)
    for i in range(3):
        await c.completions.create(model="tiny", prompt=[500 * (i + 1) + j for j in range(64)], max_tokens=1,
                                   extra_headers={WORKER_HEADER: f"kv{i}"})
    feed = fe._router.feed

    def blocks(stats: dict[str, Any]) -> dict[str, int]:
        return {w: v["blocks"] for w, v in stats["index"]["workers"].items()}

    async def synced_stats() -> dict[str, Any]:
        for _ in range(200):
            stats = await _router_call(bus, "index.stats", {})
            if all(blocks(stats).get(f"kv{i}/0", 0) >= 4 for i in range(3)) and not stats["feed"]["recovering"]:
                return stats
            await asyncio.sleep(0.05)
        raise AssertionError(f"index never caught up: {stats}")

    before = await synced_stats()
    dumps = before["feed"]["dumps"]
    actors += await _start_kv_worker(bus, "kv3")
    for _ in range(200):
        after = await _router_call(bus, "index.stats", {})
        if "kv3/0" in after["known_workers"] and after["feed"]["dumps"] > dumps and not after["feed"]["recovering"]:
            break
        await asyncio.sleep(0.05)
    await feed.wait_synced(5.0)
    after = await _router_call(bus, "index.stats", {})
    assert "kv3/0" in after["known_workers"] and after["feed"]["dumps"] == dumps + 1
    assert {w: n for w, n in blocks(after).items() if w != "kv3/0"} == blocks(before)
    assert after["index"]["blocks"] == before["index"]["blocks"]
    # the newcomer is routable and its arrival did not move an existing session
    raw = await c.completions.with_raw_response.create(model="tiny", prompt=[1000 + j for j in range(80)],
                                                       max_tokens=1)
    assert raw.headers[WORKER_HEADER] == "kv1"


async def test_router_endpoints_answer_from_the_frontend_and_agree_with_it(bus: BusContext,
                                                                           kv_stack: Any) -> None:
    fe, _ = kv_stack
    policy = fe._router
    c = client(fe)
    prompt = [7000 + j for j in range(16 * 5)]
    first = await c.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=1)
    served = first.headers[WORKER_HEADER]
    # asked over the bus right away (events may not be in yet): the same router, the same view
    longer = prompt + [1] * 32
    reply = await _router_call(bus, "route", {"token_ids": longer})
    assert reply["instance"] == served and reply["overlap_blocks"] == 5 and reply["booked"] is False
    again = await c.completions.with_raw_response.create(model="tiny", prompt=longer, max_tokens=1)
    assert again.headers[WORKER_HEADER] == served
    stats = await _router_call(bus, "index.stats", {})
    assert stats["block_size"] == policy.router.config.block_size
    assert stats["known_workers"] == ["kv0/0", "kv1/0", "kv2/0"]
    dump = await _router_call(bus, "index.dump", {"instance": served, "limit": 2})
    assert list(dump["workers"]) in ([], [f"{served}/0"])  # events may or may not have arrived yet
