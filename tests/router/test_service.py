"""RouterService over NATS with plain, header-less JSON (as `nats req` sends it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.engines.mocker import MockerEngine
from actors.engines.protocol import SamplingOptions, TokensPrompt
from actors.kv import hashing
from actors.kv.publisher import KvPublisherActor
from actors.router.service import RouterService
from actors.worker.contract import InstanceRecord
from bus import subjects as S
from bus.context import BusContext
from bus.registry import Registry
from tests.helpers import eventually

BS = 4
ARGS = {"speedup_ratio": 0, "block_size": BS, "num_gpu_blocks": 256, "max_model_len": 256}


async def call(bus: BusContext, verb: str, body: Any) -> tuple[Any, dict[str, str]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await bus.nc.request(bus.subjects.router(verb), raw, timeout=3)  # no headers at all
    return (json.loads(msg.data) if msg.data else None), dict(msg.headers or {})


@pytest.fixture
async def setup(bus: BusContext) -> AsyncIterator[tuple[RouterService, dict[str, MockerEngine]]]:
    engines: dict[str, MockerEngine] = {}
    pubs: list[KvPublisherActor] = []
    reg = Registry(bus.js, bus.subjects.bucket_instances)
    await reg.ensure()
    for inst in ("s1", "s2"):
        e = engines[inst] = MockerEngine(ARGS)
        await e.start()
        p = KvPublisherActor(bus.child(), inst, "agg", "mock", BS, e.kv_event_sources(), register=False)
        await p.start()
        pubs.append(p)
        await reg.register(inst, InstanceRecord(instance=inst, kind="engine", role="agg", model="mock",
                                                host="h", pid=1, block_size=BS))
    svc = RouterService(bus.child(), block_size=BS, instance="router-test", model="mock")
    await svc.start()
    try:
        yield svc, engines
    finally:
        await svc.stop(1.0)
        await reg.close()
        for p in pubs:
            await p.stop(0.5)
        for e in engines.values():
            await e.shutdown()


async def test_route_stats_dump_with_plain_json(bus: BusContext, setup) -> None:  # type: ignore[no-untyped-def]
    svc, engines = setup
    prompt = list(range(200, 200 + 5 * BS))
    async for _ in engines["s2"].generate(TokensPrompt(prompt), SamplingOptions(max_tokens=1), "r"):
        pass
    want = hashing.sequence_hashes(prompt, BS)
    await eventually(lambda: set(want) <= set(svc.router.index.worker_hashes(("s2", 0))))

    reply, hdrs = await call(bus, "route", {"token_ids": prompt + [1, 2, 3]})
    assert S.SERVICE_ERROR not in hdrs
    assert reply["instance"] == "s2" and reply["dp_rank"] == 0 and reply["overlap_blocks"] == 5
    assert {c["instance"]: c["overlap_blocks"] for c in reply["costs"]} == {"s1": 0, "s2": 5}
    # a query leaves no phantom load behind; a booked route holds load until `finish`
    assert reply["booked"] is False
    assert all(v["requests"] == 0 for v in svc.router.load.snapshot().values())
    reply, _ = await call(bus, "route", {"token_ids": prompt, "book": True, "request_id": "b1"})
    assert svc.router.load.snapshot()[f"{reply['instance']}/0"]["requests"] == 1
    reply, _ = await call(bus, "finish", {"request_id": "b1"})
    assert reply == {"request_id": "b1", "finished": True}
    assert all(v["requests"] == 0 for v in svc.router.load.snapshot().values())
    # explicit candidates exclude the cached worker
    reply, _ = await call(bus, "route", {"token_ids": prompt, "workers": ["s1"]})
    assert reply["instance"] == "s1" and reply["overlap_blocks"] == 0
    reply, _ = await call(bus, "route", {"token_ids": prompt, "workers": [["s2", 0]]})
    assert reply["instance"] == "s2"

    stats, _ = await call(bus, "index.stats", b"")
    assert stats["block_size"] == BS and stats["index"]["blocks"] >= 5
    assert stats["known_workers"] == ["s1/0", "s2/0"]
    assert stats["index"]["workers"]["s2/0"]["blocks"] >= 5
    assert stats["feed"]["dumps"] >= 1  # registry bootstrap

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
