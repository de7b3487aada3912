"""The ``ns.router.*`` endpoints, served by a kv-routing frontend over its own in-process router,
with plain header-less JSON (as `nats req` sends it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.base import Actor
from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import ImageInput, MultiModalInput, SamplingOptions, TokensPrompt
from actors.frontend.actor import FrontendActor
from actors.kv import hashing
from actors.router.kv_router import KvRouter
from actors.router.service import NOT_READY
from actors.worker.engine_actor import EngineActor
from actors.worker.kv_publisher import KvPublisherActor
from bus import subjects as S
from bus.context import BusContext
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.helpers import eventually

BS = 4
ARGS = {"speedup_ratio": 0, "block_size": BS, "num_gpu_blocks": 256, "max_model_len": 256,
        "input_modalities": ["text", "image"]}
MODEL = ModelConfig(name="mock", path="mock")


async def call(bus: BusContext, verb: str, body: Any) -> tuple[Any, dict[str, str]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await bus.nc.request(bus.subjects.router(verb), raw, timeout=3)  # no headers at all
    return (json.loads(msg.data) if msg.data else None), dict(msg.headers or {})


def router_of(fe: FrontendActor) -> KvRouter:
    state = fe._kv_router_state()
    assert state is not None
    return state[0]


@pytest.fixture
async def frontend(bus: BusContext) -> AsyncIterator[FrontendActor]:
    fe = FrontendActor(bus.child(), config=FrontendConfig(http="127.0.0.1:0", router="kv"), model_config=MODEL)
    await fe.start()
    try:
        yield fe
    finally:
        await fe.stop(1.0)


@pytest.fixture
async def setup(bus: BusContext, frontend: FrontendActor) -> AsyncIterator[tuple[FrontendActor, dict[str, MockerEngine]]]:
    engines: dict[str, MockerEngine] = {}
    actors: list[Actor] = []
    for inst in ("s1", "s2"):
        w = EngineActor(bus.child(), pool_name="agg", pool=PoolConfig(engine="mocker"), model=MODEL, instance=inst,
                        engine_factory=lambda: MockerEngine(dict(ARGS), role="agg", served_model_name="mock"))
        await w.start()
        engines[inst] = w.service.engine
        p = KvPublisherActor(bus.child(), inst, "agg", "mock", BS, w.service.engine.kv_event_sources())
        await p.start()
        actors += [w, p]
    await eventually(lambda: (s := frontend._kv_router_state()) is not None
                     and s[1].known_workers() == [("s1", 0), ("s2", 0)])
    try:
        yield frontend, engines
    finally:
        for a in reversed(actors):
            await a.stop(1.0)


async def test_not_ready_until_a_worker_registers(bus: BusContext, frontend: FrontendActor) -> None:
    reply, hdrs = await call(bus, "route", {"token_ids": [1, 2, 3, 4]})
    assert hdrs[S.SERVICE_ERROR_CODE] == "503" and NOT_READY in hdrs[S.SERVICE_ERROR]
    _, hdrs = await call(bus, "index.dump", b"")
    assert hdrs[S.SERVICE_ERROR_CODE] == "503"
    stats, hdrs = await call(bus, "index.stats", b"{}")
    assert S.SERVICE_ERROR not in hdrs
    assert stats["ready"] is False and stats["known_workers"] == [] and stats["index"]["blocks"] == 0


async def test_route_stats_dump_with_plain_json(bus: BusContext, setup) -> None:  # type: ignore[no-untyped-def]
    fe, engines = setup
    router = router_of(fe)
    assert router.config.block_size == BS  # from the workers' registry records, not a guess
    prompt = list(range(200, 200 + 5 * BS))
    async for _ in engines["s2"].generate(TokensPrompt(prompt), SamplingOptions(max_tokens=1), "r"):
        pass
    want = hashing.sequence_hashes(prompt, BS)
    await eventually(lambda: set(want) <= set(router.index.worker_hashes(("s2", 0))))

    reply, hdrs = await call(bus, "route", {"token_ids": prompt + [1, 2, 3]})
    assert S.SERVICE_ERROR not in hdrs
    assert reply["instance"] == "s2" and reply["dp_rank"] == 0 and reply["overlap_blocks"] == 5
    assert {c["instance"]: c["overlap_blocks"] for c in reply["costs"]} == {"s1": 0, "s2": 5}
    # a query leaves no phantom load or predicted blocks behind; a booked route holds load until `finish`
    assert reply["booked"] is False
    assert all(v["requests"] == 0 for v in router.load.snapshot().values())
    assert router.stats()["predicted"]["blocks"] == 0
    fresh = list(range(5000, 5000 + 3 * BS))
    reply, _ = await call(bus, "route", {"token_ids": fresh, "book": True, "request_id": "b1"})
    booked_on = reply["instance"]
    assert router.load.snapshot()[f"{booked_on}/0"]["requests"] == 1
    assert router.stats()["predicted"]["workers"] == {f"{booked_on}/0": 3}
    reply, _ = await call(bus, "finish", {"request_id": "b1"})
    assert reply == {"request_id": "b1", "finished": True}
    assert all(v["requests"] == 0 for v in router.load.snapshot().values())
    # the booked decision is what the frontend's own next choice builds on
    reply, _ = await call(bus, "route", {"token_ids": fresh + [7] * BS})
    assert reply["instance"] == booked_on and reply["overlap_blocks"] == 3
    # explicit candidates exclude the cached worker
    reply, _ = await call(bus, "route", {"token_ids": prompt, "workers": ["s1"]})
    assert reply["instance"] == "s1" and reply["overlap_blocks"] == 0
    reply, _ = await call(bus, "route", {"token_ids": prompt, "workers": [["s2", 0]]})
    assert reply["instance"] == "s2"

    stats, _ = await call(bus, "index.stats", b"")
    assert stats["ready"] is True and stats["mode"] == "kv"
    assert stats["block_size"] == BS and stats["index"]["blocks"] >= 5
    assert stats["known_workers"] == ["s1/0", "s2/0"]
    assert stats["index"]["workers"]["s2/0"]["blocks"] >= 5
    assert stats["feed"]["dumps"] >= 2  # registry bootstrap of each worker
    assert stats["predicted"]["blocks"] == 3

    dump, _ = await call(bus, "index.dump", {"instance": "s2"})
    assert list(dump["workers"]) == ["s2/0"]
    assert set(want) <= set(dump["workers"]["s2/0"]["blocks"])
    assert dump["workers"]["s2/0"]["block_size"] == BS
    dump, _ = await call(bus, "index.dump", b"")
    assert set(dump["workers"]) <= {"s1/0", "s2/0"}


async def test_bad_requests_get_typed_errors(bus: BusContext, setup) -> None:  # type: ignore[no-untyped-def]
    _, hdrs = await call(bus, "route", b"{not json")
    assert hdrs[S.SERVICE_ERROR_CODE] == "400"
    _, hdrs = await call(bus, "route", {"token_ids": "abc"})
    assert hdrs[S.SERVICE_ERROR_CODE] == "400"
    _, hdrs = await call(bus, "route", {"token_ids": [1], "workers": ["s1/x"]})
    assert hdrs[S.SERVICE_ERROR_CODE] == "400"
    _, hdrs = await call(bus, "route", {"token_ids": [1, 2], "role": "prefill"})
    assert hdrs[S.SERVICE_ERROR_CODE] == "503"  # no prefill worker registered
    reply, hdrs = await call(bus, "route", {"token_ids": [1, 2, 3, 4, 5]})
    assert S.SERVICE_ERROR not in hdrs and reply["instance"] in ("s1", "s2")


async def test_an_image_prompt_routes_by_its_images(bus: BusContext, setup) -> None:  # type: ignore[no-untyped-def]
    """``mm`` on the wire: the same tokens with the image a worker ran hit all its blocks there;
    another image or none hit only the text block before the image; a range outside the prompt,
    overlapping or empty is a 400."""
    fe, engines = setup
    router = router_of(fe)
    prompt = list(range(300, 300 + 5 * BS))
    image_a, image_b = "a" * 64, "b" * 64
    placeholder = (BS, 2 * BS)  # blocks 1 and 2 hold the image, block 0 is text
    mm = MultiModalInput(images=[ImageInput(uuid=image_a, data=b"png")], source_ids=prompt[:BS + 1],
                         prompt_len=len(prompt), placeholders=[placeholder])
    async for _ in engines["s1"].generate(TokensPrompt(prompt, mm=mm), SamplingOptions(max_tokens=1), "img"):
        pass
    spans = [hashing.MmSpan(image_a, *placeholder)]
    want = hashing.sequence_hashes(prompt, BS, mm=spans)
    await eventually(lambda: set(want) <= set(router.index.worker_hashes(("s1", 0))))

    reply, hdrs = await call(bus, "route", {"token_ids": prompt, "mm": [[image_a, *placeholder]]})
    assert S.SERVICE_ERROR not in hdrs, hdrs
    assert reply["instance"] == "s1" and reply["overlap_blocks"] == 5
    for other in ({"mm": [[image_b, *placeholder]]}, {}):
        reply, _ = await call(bus, "route", {"token_ids": prompt, **other})
        assert max(c["overlap_blocks"] for c in reply["costs"]) == 1, (other, reply)

    for bad in ([["", 4, 8]], [[image_a, 4, 0]], [[image_a, 16, 8]], [[image_a, -1, 4]],
                [[image_a, 4, 8], [image_b, 8, 4]], [[image_a, 4]], "x"):
        _, hdrs = await call(bus, "route", {"token_ids": prompt, "mm": bad})
        assert hdrs.get(S.SERVICE_ERROR_CODE) == "400", (bad, hdrs)
