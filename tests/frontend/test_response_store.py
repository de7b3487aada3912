"""The stored responses of /v1/responses on a real nats-server: the bucket the first frontend creates
with the topology's limits, what another connection then reads, and what is refused rather than
stored (too large, a full bucket, an id that is not one)."""

from __future__ import annotations

import asyncio

import pytest

from actors.frontend.response_store import ResponseStore, StoreUnavailable, valid_id
from bus.context import BusContext, open_context
from config.topology import ResponsesConfig

MESSAGES = [{"role": "user", "content": "hi"}]


def store(bus: BusContext, **limits: float) -> ResponseStore:
    return ResponseStore(bus.js, bus.subjects.bucket_responses, ResponsesConfig(**limits))  # type: ignore[arg-type]


async def test_a_stored_response_is_read_by_another_connection_until_deleted(bus: BusContext,
                                                                             nats_server: object) -> None:
    a = store(bus, ttl=60, max_bytes=1 << 20, max_entry_bytes=64 << 10)
    assert await a.get("resp_1") is None  # the bucket is made on first use, and holds nothing
    assert await a.put("resp_1", {"id": "resp_1", "output": []}, MESSAGES)
    status = await (await bus.js.key_value(bus.subjects.bucket_responses)).status()
    cfg = status.stream_info.config
    assert (cfg.max_age, cfg.max_bytes, cfg.max_msg_size, cfg.max_msgs_per_subject) == (60, 1 << 20, 64 << 10, 1)

    other = await open_context(nats_server.url, namespace=bus.namespace, host="h2", name="other")  # type: ignore[attr-defined]
    try:
        b = store(other)  # another process's store binds the existing bucket and keeps its limits
        got = await b.get("resp_1")
        assert got is not None and got.response == {"id": "resp_1", "output": []} and got.messages == MESSAGES
        assert await b.delete("resp_1")
        assert await a.get("resp_1") is None and not await a.delete("resp_1")
    finally:
        await other.close()


async def test_what_does_not_fit_is_not_stored(bus: BusContext) -> None:
    s = store(bus, ttl=60, max_bytes=4096, max_entry_bytes=1024)
    assert not await s.put("resp_big", {"id": "resp_big", "text": "x" * 2000}, MESSAGES)  # over the entry limit
    assert await s.get("resp_big") is None
    stored = 0
    for i in range(10):  # ~700 bytes each: the 4 KiB bucket takes a few, then refuses
        stored += await s.put(f"resp_{i}", {"id": f"resp_{i}", "text": "y" * 600}, MESSAGES)
    assert 3 <= stored < 10
    assert await s.get("resp_0") is not None  # what was stored stays (no older entry is dropped)


@pytest.mark.parametrize("rid", ["*", ">", "a.b", "", "x" * 129, "resp 1", "$KV"])
async def test_an_id_that_is_not_one_is_never_a_key(bus: BusContext, rid: str) -> None:
    assert not valid_id(rid)
    assert await store(bus).get(rid) is None


async def test_an_unreachable_bus_is_a_503_not_a_miss(bus: BusContext) -> None:
    s = store(bus)
    await s.put("resp_1", {"id": "resp_1"}, MESSAGES)
    await bus.nc.close()
    with pytest.raises(StoreUnavailable) as e:
        await asyncio.wait_for(s.get("resp_1"), 10)
    assert e.value.code == 503
