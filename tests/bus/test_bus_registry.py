"""Registry on JetStream KV: TTL expiry reaches watchers as removal; deregister is seen at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from bus.context import BusContext
from bus.registry import Registry, RegistryEvent


async def next_event(it: AsyncIterator[RegistryEvent], timeout: float = 5.0) -> RegistryEvent:
    return await asyncio.wait_for(it.__anext__(), timeout)


class Collector:
    """Drains a watch in a task (a timed-out __anext__ would cancel, i.e. close, the generator)."""

    def __init__(self, it: AsyncIterator[RegistryEvent]) -> None:
        self.q: asyncio.Queue[RegistryEvent] = asyncio.Queue()
        self.it = it
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for ev in self.it:
            self.q.put_nowait(ev)

    async def next(self, timeout: float = 5.0) -> RegistryEvent:
        return await asyncio.wait_for(self.q.get(), timeout)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_put_get_keys_items(bus: BusContext) -> None:
    reg = Registry(bus.js, bus.subjects.bucket_instances, ttl=30)
    await reg.ensure()
    assert await reg.keys() == [] and await reg.get("a") is None
    await reg.put("a", {"x": 1})
    await reg.put("b", b"raw")
    assert await reg.get("a") == b'{"x":1}'
    assert await reg.keys() == ["a", "b"]
    assert await reg.items() == {"a": b'{"x":1}', "b": b"raw"}
    # binding an existing bucket works too
    other = Registry(bus.js, bus.subjects.bucket_instances, ttl=30)
    await other.ensure()
    assert await other.get("b") == b"raw"


async def test_listing_sees_every_key_while_heartbeats_rewrite_them(bus: BusContext) -> None:
    """Every heartbeat re-puts a key. nats-py's ``KeyValue.keys()`` came back short (or empty) in
    about one listing of ten while two writers did that; the registry's listing must never."""
    reg = Registry(bus.js, bus.subjects.bucket_instances, ttl=30)
    await reg.ensure()
    keys = [f"inst-{i:02d}" for i in range(20)]
    for k in keys:
        await reg.put(k, b"v" * 200)
    stop = asyncio.Event()

    async def rewrite(offset: int) -> int:
        n = 0
        while not stop.is_set():
            await reg.put(keys[(n + offset) % len(keys)], b"w" * 200)
            n += 1
            await asyncio.sleep(0)
        return n

    writers = [asyncio.create_task(rewrite(o)) for o in (0, 10)]
    try:
        short = [sorted(set(keys) - set(await reg.keys())) for _ in range(300)]
    finally:
        stop.set()
        puts = await asyncio.gather(*writers)
    assert min(puts) > 300  # the keys were being rewritten throughout
    assert [m for m in short if m] == []


async def test_ttl_expiry_reaches_watcher_as_removal(bus: BusContext) -> None:
    reg = Registry(bus.js, bus.subjects.bucket_instances, ttl=1.0)
    await reg.ensure()
    await reg.put("early", b"1")  # exists before the watch: reported first, as added
    watch = reg.watch()
    assert await next_event(watch) == RegistryEvent("added", "early", b"1")
    await reg.put("late", b"2")
    assert await next_event(watch) == RegistryEvent("added", "late", b"2")
    removed = {(await next_event(watch, 10)).key, (await next_event(watch, 10)).key}
    assert removed == {"early", "late"}
    assert await reg.get("early") is None and await reg.keys() == []
    await watch.aclose()


async def test_a_delete_made_before_the_watch_began_is_reported(bus: BusContext) -> None:
    """A reader lists the bucket, then watches it (BucketWatch.start): a key deleted in between is
    seen by the watch only as that key's last (delete) marker, and must still be reported."""
    reg = Registry(bus.js, bus.subjects.bucket_instances, ttl=30.0)
    await reg.ensure()
    await reg.put("listed", b"1")
    assert await reg.items() == {"listed": b"1"}  # what the reader holds
    await reg.kv.delete("listed")
    watch = reg.watch()
    assert await next_event(watch) == RegistryEvent("removed", "listed", None)
    await watch.aclose()


async def test_heartbeat_keeps_entry_and_deregister_is_immediate(bus: BusContext) -> None:
    reg = Registry(bus.js, bus.subjects.bucket_instances, ttl=1.0)
    await reg.ensure()
    watch = Collector(reg.watch())
    await reg.register("inst-1", {"status": "ready"}, heartbeat=0.25)
    ev = await watch.next()
    assert (ev.kind, ev.key) == ("added", "inst-1")
    # Outlive the TTL several times: refreshes are not reported, and nothing is removed.
    await asyncio.sleep(2.5)
    assert watch.q.empty(), watch.q.get_nowait()
    assert await reg.get("inst-1") == b'{"status":"ready"}'
    await reg.register("inst-1", {"status": "draining"})  # a changed value is an update
    ev = await watch.next()
    assert (ev.kind, ev.value) == ("updated", b'{"status":"draining"}')
    t0 = time.monotonic()
    await reg.deregister("inst-1")
    ev = await watch.next(0.9)  # well before the 1 s TTL could have removed it
    assert (ev.kind, ev.key) == ("removed", "inst-1")
    assert time.monotonic() - t0 < 0.9
    assert await reg.get("inst-1") is None
    await watch.close()
    await reg.close()


async def test_binding_adopts_the_bucket_ttl(bus: BusContext) -> None:
    first = Registry(bus.js, bus.subjects.bucket_loras, ttl=2.0)
    await first.ensure()
    second = Registry(bus.js, bus.subjects.bucket_loras, ttl=60.0)
    await second.ensure()
    assert second.ttl == 2.0
