"""Checkpoint/restore flow for process snapshotters (CRIU-style), as plain logic.

With a snapshot control directory configured the worker does not go straight to serving:

1. the engine is built, then put to sleep (so no request is in flight and it is not registered);
2. we write ``ready-for-snapshot`` into the control dir;
3. the external snapshotter freezes and dumps the process, then writes one of
   - ``snapshot-complete``: the image is taken; this process has done its job and exits 0;
   - ``restore-complete``: this process is a restored copy: wake the engine, register, serve.
4. marker files we consumed are removed so the next cycle starts clean.

The actor around it (``checkpoint_actor``) drives sleep/wake over NATS.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

READY = "ready-for-snapshot"
SNAPSHOT_DONE = "snapshot-complete"
RESTORE_DONE = "restore-complete"

Outcome = Literal["snapshot-complete", "restore-complete"]


class CheckpointFlow:
    def __init__(self, control_dir: str | Path, *, sleep: Callable[[], Awaitable[None]],
                 wake: Callable[[], Awaitable[None]], poll_interval: float = 0.5,
                 timeout: float | None = None) -> None:
        self.dir = Path(control_dir)
        self._sleep = sleep
        self._wake = wake
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.state = "idle"

    def _clean(self, *names: str) -> None:
        for name in names:
            (self.dir / name).unlink(missing_ok=True)

    async def _await_marker(self) -> Outcome:
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        while True:
            # restore wins if both exist: a restored process must serve, never exit.
            if (self.dir / RESTORE_DONE).exists():
                return RESTORE_DONE
            if (self.dir / SNAPSHOT_DONE).exists():
                return SNAPSHOT_DONE
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(f"no {SNAPSHOT_DONE} or {RESTORE_DONE} in {self.dir} "
                                   f"after {self.timeout:.0f}s")
            await asyncio.sleep(self.poll_interval)

    async def run(self) -> Outcome:
        """Sleep, signal readiness, wait for the snapshotter; wake on restore."""
        self.dir.mkdir(parents=True, exist_ok=True)
        # Stale markers from a previous cycle would end this one at once.
        self._clean(READY, SNAPSHOT_DONE, RESTORE_DONE)
        self.state = "sleeping"
        await self._sleep()
        (self.dir / READY).write_text("ready\n")
        self.state = "waiting"
        log.info("checkpoint: engine asleep, wrote %s; waiting for the snapshotter", self.dir / READY)
        outcome = await self._await_marker()
        self._clean(READY, outcome)
        if outcome == RESTORE_DONE:
            log.info("checkpoint: restored from snapshot; waking the engine")
            await self._wake()
            self.state = "serving"
        else:
            log.info("checkpoint: snapshot complete; this process exits")
            self.state = "snapshotted"
        return outcome
