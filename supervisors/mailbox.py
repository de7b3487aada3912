"""A supervisor's mailbox: the one queue its loop reads (child exits, finished starts, escalations,
operator commands), so that every state change happens in that loop, one event at a time.

An operator command is a coroutine function the loop runs; its caller awaits a future that the loop
resolves with the result (or the error). Commands still queued when the supervisor ends fail with
``Unavailable`` so that no caller hangs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from bus.errors import Unavailable

# ("exit", slot, gen, exc) | ("started", slot, gen, child, exc) | ("escalate", child_id, reason)
# | ("cmd", fn, future)
Event = tuple[Any, ...]
Command = Callable[[], Awaitable[Any]]


class Mailbox:
    def __init__(self, owner: str) -> None:
        self.owner = owner  # the supervisor's name, for errors
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def post(self, ev: Event) -> None:
        self._queue.put_nowait(ev)

    def take(self) -> Event | None:
        """The next queued event, None when there is none."""
        return None if self._queue.empty() else self._queue.get_nowait()

    async def next(self, timeout: float | None) -> Event | None:
        """The next event, waiting at most ``timeout`` seconds (None on timeout)."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def call(self, fn: Command) -> Any:
        """Have the loop run ``fn``; return its result or raise its error."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.post(("cmd", fn, fut))
        return await fut

    async def run(self, fn: Command, fut: asyncio.Future[Any]) -> None:
        """Run a command event in the loop and hand its outcome to the caller."""
        try:
            res = await fn()
        except asyncio.CancelledError:
            if not fut.done():
                fut.set_exception(Unavailable(f"supervisor {self.owner} stopped"))
            raise
        except Exception as e:
            if not fut.done():
                fut.set_exception(e)
        else:
            if not fut.done():
                fut.set_result(res)

    def close(self) -> None:
        """Fail the commands still queued so their callers do not hang."""
        while (ev := self.take()) is not None:
            if ev[0] == "cmd" and not ev[2].done():
                ev[2].set_exception(Unavailable(f"supervisor {self.owner} stopped"))
