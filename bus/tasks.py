"""Stopping background tasks so that a stop always ends.

nats-py swallows a task's cancellation in some of its awaits (measured: a task cancelled 0-10 ms
after it starts ``KeyValue.watch()`` returned from the setup normally in 82 of 500 tries, and then
waited on the watch forever). A stop that cancels once and awaits the task then hangs, and
so does everything stopping after it. :func:`cancel_and_wait` cancels again until the task ends,
and gives up after a bound (naming the task) instead of hanging. :func:`honouring_cancel` wraps
such an await so that the cancellation it lost is raised after all.

The await that loses it is ``nats.aio.client.Client.request``: Python 3.11's ``asyncio.wait_for``
returns the result when the reply and the cancel arrive in the same loop turn (CPython gh-86296;
3.12's rewrite of ``wait_for`` on ``asyncio.timeout`` fixed it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# Between two cancels of a task that ignored the previous one: long enough for a task that does
# honour the cancel to finish its cleanup (an unsubscribe, a purge) first.
RECANCEL_INTERVAL = 0.2


async def cancel_and_wait(tasks: Iterable[asyncio.Future[object]], *, timeout: float = 5.0) -> set[asyncio.Future[object]]:
    """Cancel ``tasks`` and wait until they end, re-cancelling any that keep running; returns those
    still running after ``timeout`` (logged). The caller's own cancellation is never swallowed,
    and the tasks' results and exceptions are consumed (a stop is not the place to report them)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    first = True
    while pending:
        for t in pending:
            if not first:
                log.debug("task %s ignored a cancel; cancelling it again", _name(t))
            t.cancel()
        first = False
        left = deadline - loop.time()
        if left <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_INTERVAL, left))
    for t in pending:
        log.warning("task %s still running %.1fs after it was cancelled; leaving it", _name(t), timeout)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved, so asyncio does not log "exception was never retrieved"
    return pending


def cancels() -> int:
    """How many cancels the current task has been asked for (0 outside a task); compare two
    readings around an await to see whether it lost one."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


async def honouring_cancel(aw: Awaitable[T]) -> T:
    """``await aw``, but raise ``CancelledError`` if the task was cancelled meanwhile and ``aw``
    returned anyway. Only a cancel requested *during* the await counts: cleanup that runs after a
    cancel was handled (a ``finally`` that deregisters) must still be able to make requests."""
    asked = cancels()
    result = await aw
    if cancels() > asked:
        raise asyncio.CancelledError
    return result


def _name(t: asyncio.Future[object]) -> str:
    return t.get_name() if isinstance(t, asyncio.Task) else repr(t)
