"""Parallel starts for one Supervisor: which due children may begin now, and their start tasks.

Children whose spec says ``parallel`` do not depend on each other (worker processes), so several
of them load at once, each in a task of its own, while the supervisor's loop goes on handling
exits and commands. A finished start never touches the supervisor's state: it posts a
``("started", slot, gen, child, exc)`` event and the loop decides, so strategies still run one at
a time. Non-parallel children keep OTP order: one starts only once every child before it is up,
and nothing after it begins until it is up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from supervisors.child import Child
from supervisors.slot import Slot

# A child that reports its own progress (ProcessChild relays the process's STATUS= lines) has a
# ``status`` string and an ``on_status`` callback slot; the supervisor fills the latter.
_MAX_LISTED = 4  # children named in one progress line; a status line must stay short
_MAX_CHILD_STATUS = 60


def plan_starts(slots: list[Slot], now: float, in_flight: int,
                limit: int) -> tuple[list[Slot], Slot | None]:
    """The parallel children to start now (at most ``limit`` in flight), or the one non-parallel
    child to start now. A non-parallel child that is not up holds back everything after it."""
    picks: list[Slot] = []
    for i, s in enumerate(slots):
        due = s.state == "restarting" and s.deadline <= now
        if s.spec.parallel:
            if due and in_flight + len(picks) < limit:
                picks.append(s)
            continue
        if s.state in ("running", "stopped"):
            continue
        if due and not picks and all(p.state in ("running", "stopped") for p in slots[:i]):
            return [], s
        break
    return picks, None


def next_wakeup(slots: list[Slot], now: float) -> float | None:
    """Seconds until the next backoff deadline. Due children held back (by order or the bound) are
    not counted: a start finishing posts an event, and that is what unblocks them."""
    pending = [s.deadline for s in slots if s.state == "restarting" and s.deadline > now]
    return min(pending) - now if pending else None


def child_status(child: Child | None) -> str | None:
    status = getattr(child, "status", None) if child is not None else None
    return status if isinstance(status, str) and status else None


def listen(child: Child, callback: Callable[[str], None]) -> None:
    """Have a child that reports progress call ``callback`` on each new status line (only when
    nobody else listens: a nested supervisor's ``on_status`` already goes to its relay)."""
    # not part of the Child protocol, hence getattr/setattr
    if hasattr(child, "status") and getattr(child, "on_status", False) is None:  # noqa: B009
        setattr(child, "on_status", callback)  # noqa: B010


def progress_line(name: str, slots: list[Slot]) -> str:
    """One short line for sd_notify, e.g. ``local: 2/4 up; worker-a-0 starting (engine loading)``."""
    live = [s for s in slots if s.state != "stopped"]
    up = sum(s.state == "running" for s in live)
    parts = [f"{name}: {up}/{len(live)} up"]
    starting = [s for s in live if s.state == "starting"]
    for s in starting[:_MAX_LISTED]:
        st = child_status(s.child)
        if st is not None and len(st) > _MAX_CHILD_STATUS:
            st = st[:_MAX_CHILD_STATUS - 3] + "..."
        parts.append(f"{s.spec.id} starting" + (f" ({st})" if st else ""))
    if len(starting) > _MAX_LISTED:
        parts.append(f"{len(starting) - _MAX_LISTED} more starting")
    waiting = sum(s.state == "restarting" for s in live)
    if waiting:
        parts.append(f"{waiting} waiting")
    return "; ".join(parts)


class Starter:
    """The in-flight start tasks of one supervisor."""

    def __init__(self, name: str, post: Callable[[tuple[Any, ...]], None],
                 kill: Callable[[Child], Awaitable[None]]) -> None:
        self.name = name
        self._post = post
        self._kill = kill
        self._tasks: dict[Slot, asyncio.Task[None]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def busy(self, slot: Slot) -> bool:
        return slot in self._tasks

    def begin(self, slot: Slot, on_child: Callable[[Child], None]) -> None:
        """Start ``slot``'s child in a task; ``on_child`` sees the child as soon as it exists."""
        slot.state = "starting"
        self._tasks[slot] = asyncio.create_task(self._start(slot, slot.gen, on_child),
                                                name=f"start:{self.name}/{slot.spec.id}")

    def finished(self, slot: Slot) -> None:
        """The loop took the task's result."""
        self._tasks.pop(slot, None)

    async def _start(self, slot: Slot, gen: int, on_child: Callable[[Child], None]) -> None:
        child: Child | None = None
        try:
            child = slot.spec.start()
            slot.child = child  # visible at once: operators see its pid and status while it loads
            on_child(child)
            await child.start()
        except asyncio.CancelledError:
            await self._drop(slot, child)
            raise
        except Exception as e:
            await self._drop(slot, child)
            self._post(("started", slot, gen, None, e))
            return
        self._post(("started", slot, gen, child, None))

    async def _drop(self, slot: Slot, child: Child | None) -> None:
        if child is not None:
            await self._kill(child)  # a half-started child must not linger
        if slot.child is child:
            slot.child = None

    async def cancel(self, slot: Slot) -> None:
        """Abort ``slot``'s start (its half-started child is killed); returns once it is gone. A
        start that already succeeded leaves its child in ``slot.child`` for the caller to stop."""
        task = self._tasks.get(slot)
        if task is None:
            return
        if not task.done() and not task.cancelling():
            task.cancel()  # never twice: a second cancel would interrupt the kill
        await asyncio.wait({task})
        if self._tasks.get(slot) is task:
            del self._tasks[slot]

    async def cancel_all(self) -> None:
        await asyncio.gather(*(self.cancel(s) for s in list(self._tasks)))
