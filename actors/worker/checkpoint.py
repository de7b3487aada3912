"""Checkpoint/restore for process snapshotters (CRIU-style), as plain logic (no NATS).

With a snapshot control directory configured, a worker process prepares an image before it has any
bus connection (``actors.worker.process`` runs this first, so the image holds no NATS or HTTP
sockets that would be stale in every restored copy):

1. the engine is built, then put to sleep (direct engine calls: nothing is registered yet);
2. we write ``ready-for-snapshot`` into the control dir (``on_ready`` runs then: readiness for the
   parent supervisor);
3. the external snapshotter freezes and dumps the process, then writes one of
   - ``snapshot-complete``: the image is taken; this process has done its job and exits for good;
   - ``restore-complete``: this process is a restored copy: wake the engine, then connect and serve;
4. marker files we consumed are removed so the next cycle starts clean.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from actors.engines.protocol import Engine
from config.topology import CheckpointConfig

log = logging.getLogger(__name__)

READY = "ready-for-snapshot"
SNAPSHOT_DONE = "snapshot-complete"
RESTORE_DONE = "restore-complete"

Outcome = Literal["snapshot-complete", "restore-complete"]


class CheckpointFlow:
    def __init__(self, control_dir: str | Path, *, sleep: Callable[[], Awaitable[None]],
                 wake: Callable[[], Awaitable[None]], on_ready: Callable[[], None] | None = None,
                 poll_interval: float = 0.5, timeout: float | None = None) -> None:
        self.dir = Path(control_dir)
        self._sleep = sleep
        self._wake = wake
        self._on_ready = on_ready
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
        if self._on_ready is not None:
            self._on_ready()
        log.info("checkpoint: engine asleep, wrote %s; waiting for the snapshotter", self.dir / READY)
        try:
            outcome = await self._await_marker()
        except BaseException:
            self._clean(READY)  # a process that stopped waiting must not be imaged
            raise
        self._clean(READY, outcome)
        if outcome == RESTORE_DONE:
            log.info("checkpoint: restored from snapshot; waking the engine")
            await self._wake()
            self.state = "restored"
        else:
            log.info("checkpoint: snapshot complete")
            self.state = "snapshotted"
        return outcome


async def prepare(engine: Engine, config: CheckpointConfig, stop: asyncio.Event, *,
                  on_ready: Callable[[], None] | None = None) -> Outcome | None:
    """Start ``engine`` (not started yet), sleep it and wait for the snapshotter: the outcome (the
    engine is awake after a restore, still asleep after a snapshot), or None when ``stop`` was set
    first. The caller owns the engine either way (shutting it down is its call)."""
    assert config.control_dir, "checkpoint mode needs checkpoint.control_dir"

    async def cycle() -> Outcome:
        await engine.start()
        flow = CheckpointFlow(config.control_dir or "", sleep=lambda: engine.sleep(1), wake=engine.wake_up,
                              on_ready=on_ready, poll_interval=config.poll_interval)
        return await flow.run()

    task = asyncio.create_task(cycle(), name="checkpoint")
    stopper = asyncio.create_task(stop.wait(), name="checkpoint-stop")
    try:
        # a SIGTERM while the engine loads or while we wait for the snapshotter ends the process
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()
