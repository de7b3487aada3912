"""Checkpoint flow against a simulated snapshotter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.worker.checkpoint import READY, RESTORE_DONE, SNAPSHOT_DONE, CheckpointFlow


class Engine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def sleep(self) -> None:
        self.calls.append("sleep")

    async def wake(self) -> None:
        self.calls.append("wake")


async def snapshotter(control: Path, outcome: str, seen: list[str]) -> None:
    """What CRIU tooling does: wait for the ready marker, 'dump', then write the outcome marker."""
    while not (control / READY).exists():
        await asyncio.sleep(0.01)
    seen.append((control / READY).read_text())
    (control / outcome).write_text("done")


@pytest.mark.parametrize("outcome,calls", [(SNAPSHOT_DONE, ["sleep"]), (RESTORE_DONE, ["sleep", "wake"])])
async def test_flow(tmp_path: Path, outcome: str, calls: list[str]) -> None:
    eng, seen = Engine(), []
    (tmp_path / SNAPSHOT_DONE).write_text("stale from a previous cycle")
    flow = CheckpointFlow(tmp_path, sleep=eng.sleep, wake=eng.wake, poll_interval=0.01)
    sim = asyncio.create_task(snapshotter(tmp_path, outcome, seen))
    assert await asyncio.wait_for(flow.run(), 5) == outcome
    await sim
    assert eng.calls == calls and seen == ["ready\n"]
    # the ready marker was written only after sleep, and every marker is cleaned up
    assert list(tmp_path.iterdir()) == []
    assert flow.state == ("serving" if outcome == RESTORE_DONE else "snapshotted")


async def test_timeout(tmp_path: Path) -> None:
    eng = Engine()
    flow = CheckpointFlow(tmp_path, sleep=eng.sleep, wake=eng.wake, poll_interval=0.01, timeout=0.1)
    with pytest.raises(TimeoutError, match="restore-complete"):
        await flow.run()
    assert eng.calls == ["sleep"]
