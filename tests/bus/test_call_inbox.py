"""A stream call's inbox waits with one timer per call: each wait still ends at its own deadline."""

from __future__ import annotations

import asyncio
import time

from bus.stream import _CallInbox


async def _later(box: _CallInbox, delay: float, msg: object) -> None:
    await asyncio.sleep(delay)
    box.put(msg)  # type: ignore[arg-type]


async def test_a_wait_ends_at_its_own_timeout() -> None:
    box = _CallInbox()
    t0 = time.monotonic()
    assert await box.get(0.1) is None
    waited = time.monotonic() - t0
    assert 0.09 <= waited < 1.0
    box.stop_timer()


async def test_a_message_ends_the_wait_and_a_shorter_wait_after_it_is_not_held_by_the_longer_timer() -> None:
    box = _CallInbox()
    asyncio.ensure_future(_later(box, 0.02, "m1"))
    assert await box.get(30.0) == "m1"  # arms a 30 s timer
    t0 = time.monotonic()
    assert await box.get(0.1) is None  # needs an earlier deadline: the timer moves
    assert 0.09 <= time.monotonic() - t0 < 1.0
    box.stop_timer()


async def test_a_longer_wait_after_a_shorter_one_waits_its_whole_timeout() -> None:
    box = _CallInbox()
    asyncio.ensure_future(_later(box, 0.01, "m1"))
    assert await box.get(0.05) == "m1"  # arms a timer 50 ms out; nothing waits when it fires
    t0 = time.monotonic()
    assert await box.get(0.3) is None  # the earlier timer must not end this wait at ~50 ms
    assert 0.28 <= time.monotonic() - t0 < 2.0
    box.stop_timer()


async def test_messages_already_queued_are_returned_without_waiting() -> None:
    box = _CallInbox()
    box.put("a")  # type: ignore[arg-type]
    box.put("b")  # type: ignore[arg-type]
    assert await box.get(0.0) == "a" and await box.get(0.0) == "b"
    assert box._timer is None  # nothing waited, so nothing was armed


async def test_a_closed_call_leaves_no_timer_behind() -> None:
    box = _CallInbox()
    asyncio.ensure_future(_later(box, 0.01, "m1"))
    assert await box.get(30.0) == "m1"
    timer = box._timer
    assert timer is not None and not timer.cancelled()
    box.stop_timer()
    assert timer.cancelled() and box._timer is None
