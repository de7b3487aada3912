"""Stopping tasks always ends: a cancel lost inside nats-py is raised after all (bus.tasks), and a stop
re-cancels a task that ignored one instead of waiting on it forever.

The real-server tests cancel at random moments; before the fix about one cancel in seven was lost
inside ``KeyValue.watch()``'s setup requests (Python 3.11's ``wait_for`` returns a reply that
arrives in the same loop turn as the cancel), so 60 rounds fail with near certainty without it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from bus import rpc
from bus.context import BusContext
from bus.registry import Registry
from bus.tasks import cancel_and_wait, honouring_cancel

ROUNDS = 60


async def _stubborn(times: int, ended: list[bool]) -> None:
    """Ignores its first ``times`` cancels (as an await that loses one does)."""
    ignored = 0
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if ignored >= times:
                ended.append(True)
                raise
            ignored += 1


async def test_cancel_and_wait_recancels_a_task_that_ignored_the_cancel() -> None:
    ended: list[bool] = []
    t = asyncio.create_task(_stubborn(2, ended))
    await asyncio.sleep(0)
    assert await cancel_and_wait([t], timeout=5.0) == set()
    assert t.cancelled() and ended == [True]


async def test_cancel_and_wait_gives_up_after_its_bound_and_names_what_still_runs() -> None:
    ended: list[bool] = []
    t = asyncio.create_task(_stubborn(10**9, ended), name="never-ends")
    await asyncio.sleep(0)
    assert await cancel_and_wait([t], timeout=0.5) == {t}
    assert not t.done()
    t.get_coro().close()  # test cleanup: a coroutine that ignores every cancel
    t.cancel()


async def test_cancel_and_wait_consumes_results_and_never_swallows_its_callers_cancel() -> None:
    async def boom() -> None:
        raise RuntimeError("ended badly before the stop")

    failed = asyncio.create_task(boom())
    await asyncio.sleep(0)
    assert await cancel_and_wait([failed]) == set()  # no "exception was never retrieved" either

    ended: list[bool] = []
    child = asyncio.create_task(_stubborn(10**9, ended))
    stopper = asyncio.create_task(cancel_and_wait([child], timeout=30.0))
    await asyncio.sleep(0.3)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    child.get_coro().close()
    child.cancel()


async def test_honouring_cancel_raises_a_cancel_the_awaitable_swallowed() -> None:
    async def swallows() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass
        return "reply"

    t = asyncio.create_task(honouring_cancel(swallows()))
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t


async def test_honouring_cancel_lets_cleanup_after_a_handled_cancel_run() -> None:
    """A ``finally`` after a cancel (deregister, purge) must still be able to await requests."""
    async def cleanup() -> str:
        return "cleaned"

    async def body() -> str:
        try:
            await asyncio.sleep(10)
        finally:
            result.append(await honouring_cancel(cleanup()))
        return "unreachable"

    result: list[str] = []
    t = asyncio.create_task(body())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert result == ["cleaned"]


async def _cancel_at_random_moments(work: Callable[[], Coroutine[Any, Any, None]], what: str, seed: int) -> None:
    """Start ``work``, cancel it once a random few ms later, and require it to end; ROUNDS times."""
    rng = random.Random(seed)
    for i in range(ROUNDS):
        t = asyncio.create_task(work())
        await asyncio.sleep(rng.uniform(0, 0.01))
        t.cancel()
        done, _ = await asyncio.wait([t], timeout=5)
        assert done, f"round {i}: {what} went on after its cancel"


async def test_a_registry_watch_cancelled_at_any_moment_ends_on_one_cancel(bus: BusContext) -> None:
    reg = Registry(bus.js, bus.subjects.bucket_instances, 10)
    await reg.ensure()
    for i in range(20):
        await reg.register(f"w{i}", {"i": i})

    async def consume() -> None:
        async for _ in reg.watch():
            pass

    try:
        await _cancel_at_random_moments(consume, "the watch", seed=7)
    finally:
        await reg.close()


async def test_a_request_loop_cancelled_at_any_moment_ends_on_one_cancel(bus: BusContext) -> None:
    subject = bus.subjects.echo("ping")

    async def echo(msg) -> None:  # type: ignore[no-untyped-def]
        await msg.respond(msg.data)

    sub = await bus.nc.subscribe(subject, cb=echo)

    async def ask_forever() -> None:
        while True:
            await rpc.request(bus.nc, subject, {"x": 1}, timeout=5)

    try:
        await _cancel_at_random_moments(ask_forever, "the request loop", seed=11)
    finally:
        await sub.unsubscribe()
