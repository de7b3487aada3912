"""actors.instances: the one watch of a registry bucket that every consumer in a process shares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from actors.instances.contract import InstanceRecord
from actors.instances.watch import BucketWatch, watch_instances
from bus.backoff import Backoff
from bus.context import BusContext
from bus.registry import RegistryEvent
from tests.helpers import eventually


def record(instance: str, kind: str = "engine", status: str = "ready") -> InstanceRecord:
    return InstanceRecord(instance=instance, kind=kind, role="agg", model="m", host="h", pid=1, status=status)


async def test_subscribers_share_one_decoded_view(bus: BusContext) -> None:
    watch = watch_instances(bus, 10.0)
    reg = watch.registry
    await reg.ensure()
    await reg.put("w1", record("w1"))
    await reg.put("bad", b"{not json")
    await watch.start()
    try:
        early: list[tuple[str, object]] = []
        watch.subscribe(lambda k, v: early.append((k, v)), lambda k: early.append((k, None)))
        assert early == [("w1", record("w1"))]  # current entries at once; the malformed one skipped
        late: list[tuple[str, object]] = []
        unsubscribe = watch.subscribe(lambda k, v: late.append((k, v)), lambda k: late.append((k, None)))
        await reg.put("w1", record("w1"))  # an unchanged value (a heartbeat) is not handed on
        await reg.put("w2", record("w2", kind="frontend"))
        await eventually(lambda: len(late) == 2)
        assert late == [("w1", record("w1")), ("w2", record("w2", kind="frontend"))]
        assert watch.entries["w1"].is_worker and not watch.entries["w2"].is_worker
        await reg.put("w1", record("w1", status="sleeping"))
        await eventually(lambda: len(early) == 3)
        assert early[-1] == ("w1", record("w1", status="sleeping"))
        unsubscribe()
        await reg.deregister("w2")
        await eventually(lambda: early[-1] == ("w2", None))
        assert len(late) == 3 and "w2" not in watch.entries
    finally:
        await watch.stop()


async def test_a_broken_watch_is_watched_again_and_resynced(bus: BusContext, monkeypatch: Any) -> None:
    watch: BucketWatch[dict[str, Any]] = BucketWatch(bus.js, bus.subjects.bucket_loras, 10.0, dict[str, Any],
                                                     backoff=Backoff(initial=0.05, max=0.05))
    reg = watch.registry
    await reg.ensure()
    await reg.put("a", {"n": 1})
    real = reg.watch
    broken, resume = asyncio.Event(), asyncio.Event()

    async def first_breaks(key_filter: str = ">") -> AsyncIterator[RegistryEvent]:
        if not broken.is_set():
            broken.set()
            await resume.wait()
            raise ConnectionError("server restarted")
        async for ev in real(key_filter):
            yield ev

    monkeypatch.setattr(reg, "watch", first_breaks)
    await watch.start()
    seen: list[str] = []
    watch.subscribe(lambda k, v: seen.append(f"+{k}"), lambda k: seen.append(f"-{k}"))
    try:
        await broken.wait()
        await reg.kv.purge("a")  # while nothing watches: only the resync can tell
        await reg.put("b", {"n": 2})
        resume.set()
        await eventually(lambda: seen == ["+a", "-a", "+b"])
        assert watch.entries == {"b": {"n": 2}}
    finally:
        await watch.stop()
