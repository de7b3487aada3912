"""Checkpoint/restore: the flow against a simulated snapshotter, and the worker's pre-bus phase
(run_worker with the mocker): engine built and asleep before any bus connection, snapshot-complete
ends the process with its own exit code, restore-complete serves with the engine built before."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from actors.engines.protocol import Engine
from actors.worker.checkpoint import READY, RESTORE_DONE, SNAPSHOT_DONE, CheckpointFlow
from actors.worker.process import EXIT_OK, EXIT_SNAPSHOT_DONE, default_engine_factory, run_worker
from bus.context import open_context
from bus.registry import Registry
from config.loader import load_topology
from config.topology import Topology
from supervisors.sdnotify import Notifier
from tests.worker.test_worker_children import engine_instance, generate, write


class Engine_:
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
    eng, seen, ready_at = Engine_(), [], []
    (tmp_path / SNAPSHOT_DONE).write_text("stale from a previous cycle")
    flow = CheckpointFlow(tmp_path, sleep=eng.sleep, wake=eng.wake, poll_interval=0.01,
                          on_ready=lambda: ready_at.append((list(eng.calls), (tmp_path / READY).exists())))
    sim = asyncio.create_task(snapshotter(tmp_path, outcome, seen))
    assert await asyncio.wait_for(flow.run(), 5) == outcome
    await sim
    assert eng.calls == calls and seen == ["ready\n"]
    assert ready_at == [(["sleep"], True)]  # readiness is told once the engine sleeps and the marker exists
    assert list(tmp_path.iterdir()) == []  # every marker is cleaned up
    assert flow.state == ("restored" if outcome == RESTORE_DONE else "snapshotted")


async def test_timeout_and_cancel_remove_the_ready_marker(tmp_path: Path) -> None:
    eng = Engine_()
    flow = CheckpointFlow(tmp_path, sleep=eng.sleep, wake=eng.wake, poll_interval=0.01, timeout=0.1)
    with pytest.raises(TimeoutError, match="restore-complete"):
        await flow.run()
    assert eng.calls == ["sleep"] and not (tmp_path / READY).exists()
    task = asyncio.create_task(CheckpointFlow(tmp_path, sleep=eng.sleep, wake=eng.wake, poll_interval=0.01).run())
    while not (tmp_path / READY).exists():
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not (tmp_path / READY).exists()  # a snapshotter must not image a process that gave up


# --- run_worker in checkpoint mode -----------------------------------------------------------------


class NotifySink:
    """The parent's end of sd_notify (what ProcessChild binds)."""

    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / f"notify-{secrets.token_hex(3)}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)

    def notifier(self) -> Notifier:
        return Notifier({"NOTIFY_SOCKET": self.path})

    def lines(self) -> list[str]:
        out: list[str] = []
        while True:
            try:
                out += self.sock.recv(4096).decode().splitlines()
            except BlockingIOError:
                return out


@pytest.fixture
async def tcp_trap() -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP listener posing as the bus: the URL, and one entry per connection it was offered."""
    conns: list[int] = []

    async def on_conn(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"nats://127.0.0.1:{port}", conns
    finally:
        srv.close()
        await srv.wait_closed()


def checkpoint_topology(tmp: Path, url: str, ns: str, args: str = "") -> tuple[Topology, Path]:
    control = tmp / "snap"
    topo = write(tmp, url, ns, extra=f'[pools.agg.checkpoint]\ncontrol_dir = "{control}"\npoll_interval = 0.02',
                 args=args)
    return load_topology(topo), control


def counting_factory(t: Topology, built: list[Engine]) -> Callable[[], Engine]:
    make = default_engine_factory(t, "agg", 0)

    def factory() -> Engine:
        built.append(make())
        return built[-1]

    return factory


async def until(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"{what}: not reached in {timeout}s")
        await asyncio.sleep(0.02)


async def test_snapshot_complete_exits_with_its_code_and_never_touches_the_bus(
        tmp_path: Path, tcp_trap: tuple[str, list[int]]) -> None:
    url, conns = tcp_trap
    t, control = checkpoint_topology(tmp_path, url, f"c{secrets.token_hex(3)}")
    sink, built = NotifySink(tmp_path), []
    worker = asyncio.create_task(run_worker(t, "agg", 0, stop=asyncio.Event(), notifier=sink.notifier(),
                                            engine_factory=counting_factory(t, built)))
    await until(lambda: (control / READY).exists() or worker.done(), "ready-for-snapshot")
    assert not worker.done()
    assert len(built) == 1 and await built[0].is_sleeping()  # built, then asleep, before the marker
    seen = sink.lines()
    assert "READY=1" in seen and any(s.startswith("STATUS=") and "snapshotter" in s for s in seen), seen
    (control / SNAPSHOT_DONE).write_text("ok")
    assert await asyncio.wait_for(worker, 15) == EXIT_SNAPSHOT_DONE
    assert "STATUS=snapshot complete; not restarted" in sink.lines()
    assert conns == []  # no bus connection was ever attempted
    assert list(control.iterdir()) == []


async def test_stop_while_waiting_for_the_snapshotter(tmp_path: Path, tcp_trap: tuple[str, list[int]]) -> None:
    url, conns = tcp_trap
    t, control = checkpoint_topology(tmp_path, url, f"c{secrets.token_hex(3)}")
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(t, "agg", 0, stop=stop, notifier=NotifySink(tmp_path).notifier()))
    await until(lambda: (control / READY).exists() or worker.done(), "ready-for-snapshot")
    stop.set()
    assert await asyncio.wait_for(worker, 15) == EXIT_OK
    assert conns == [] and not (control / READY).exists()


async def test_restore_serves_with_the_engine_built_before_the_bus(nats_server, tmp_path: Path) -> None:
    ns = f"c{secrets.token_hex(3)}"
    t, control = checkpoint_topology(tmp_path, nats_server.url, ns, args="die_after_tokens = 40")
    built: list[Engine] = []
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(t, "agg", 0, stop=stop, notifier=NotifySink(tmp_path).notifier(),
                                            engine_factory=counting_factory(t, built)))
    ctx = await open_context(nats_server.url, ns, "local", "test")
    reg = Registry(ctx.js, ctx.subjects.bucket_instances)
    await reg.ensure()
    try:
        await until(lambda: (control / READY).exists() or worker.done(), "ready-for-snapshot")
        await asyncio.sleep(0.3)  # time enough for anything that would wrongly register
        assert await reg.items() == {}  # nothing of the worker exists on the bus yet
        (control / RESTORE_DONE).write_text("ok")  # the simulated snapshotter restored us
        inst = await engine_instance(ctx)
        assert await generate(ctx, inst, list(range(40)), n=8)
        assert len(built) == 1 and not await built[0].is_sleeping()  # adopted, awake, not rebuilt
        assert list(control.iterdir()) == []  # markers cleaned up, ready-for-snapshot not rewritten

        # an engine death after the restore: the restart builds a fresh engine, with no new cycle
        first = json.loads(await reg.get(inst) or b"{}")["started_at"]
        with pytest.raises(Exception):  # noqa: B017 - the stream ends with a typed engine error
            for _ in range(10):
                await generate(ctx, inst, list(range(40)), n=16)
        for _ in range(300):
            raw = await reg.get(inst)
            if raw and json.loads(raw)["started_at"] != first:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the engine was not restarted")
        assert len(built) >= 2 and built[0].dead.is_set()  # fresh engine(s), the adopted one is gone
        assert await generate(ctx, inst, list(range(40)), n=4)
        assert not (control / READY).exists()
    finally:
        stop.set()
        assert await asyncio.wait_for(worker, 30) == EXIT_OK
        await ctx.close()
