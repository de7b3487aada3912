"""Stopping a supervisor's children on purpose: each within its spec's shutdown timeout, killed when
it overruns or fails to stop, in reverse start order for the whole set. A stop is never a crash:
the slot's generation bumps so that an exit already reported for it is ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from bus.errors import Unavailable
from supervisors.child import Child
from supervisors.slot import Slot, describe
from supervisors.starter import Starter

log = logging.getLogger(__name__)

# Extra time given to a child's own stop(timeout) before it is killed outright.
_STOP_GRACE = 1.0
# A kill (stop(None)) that hangs this long is logged and abandoned, so a stop always ends.
_KILL_TIMEOUT = 10.0


async def kill(owner: str, child: Child) -> None:
    """Stop ``child`` at once; never raises (``owner``, the supervisor's name, is for the log)."""
    try:
        await asyncio.wait_for(child.stop(None), _KILL_TIMEOUT)
    except Exception as e:
        log.error("supervisor %s: killing %s failed: %s", owner, child.name, describe(e))


async def stop_slot(owner: str, starter: Starter, slot: Slot,
                    timeout: float | None | Literal["spec"] = "spec") -> None:
    """Stop a running or starting child on purpose: its exit is not a crash."""
    await starter.cancel(slot)  # a start in flight kills its half-started child
    child = slot.child
    if slot.monitor is not None:
        slot.monitor.cancel()
        slot.monitor = None
    slot.gen += 1  # any exit event already queued is now stale
    if child is None:
        return
    t = slot.spec.shutdown_timeout if timeout == "spec" else timeout
    try:
        if t is None:
            await kill(owner, child)
        else:
            await asyncio.wait_for(child.stop(t), t + _STOP_GRACE)
    except asyncio.CancelledError:
        await kill(owner, child)  # interrupted mid-stop (supervisor stopping): finish the job
        slot.child = None
        raise
    except Exception as e:
        log.warning("supervisor %s: child %s did not stop cleanly (%s); killing",
                    owner, slot.spec.id, describe(e))
        await kill(owner, child)
    slot.child = None
    log.info("supervisor %s: child %s stopped", owner, slot.spec.id)


async def stop_all(owner: str, starter: Starter, slots: list[Slot], timeout: float | None) -> None:
    """Stop every child in reverse start order, the whole within ``timeout`` (None: kill each at
    once), and fail whoever waits for one of them to come up."""
    deadline = None if timeout is None else time.monotonic() + timeout
    await starter.cancel_all()  # no start in flight may leave a child behind
    for slot in reversed(slots):
        if slot.child is None:
            slot.state = "stopped"
            continue
        t: float | None = slot.spec.shutdown_timeout
        if deadline is None:
            t = None
        elif t is not None:
            t = max(0.0, min(t, deadline - time.monotonic()))
        await stop_slot(owner, starter, slot, t)
        slot.state = "stopped"
    for slot in slots:
        slot.resolve(Unavailable(f"supervisor {owner} stopped"))
