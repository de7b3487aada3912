"""sd_notify against a fake NOTIFY_SOCKET, in both the path and the abstract '@' forms."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.backoff import Backoff
from supervisors.child import ChildSpec
from supervisors.sdnotify import Notifier, serve_root, socket_address
from supervisors.supervisor import Supervisor


class FakeSystemd:
    """The receiving end of NOTIFY_SOCKET."""

    def __init__(self, form: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if form == "path":
            # a short dir: unix socket paths are limited to 107 bytes
            self.dir = tempfile.mkdtemp(prefix="sdn-")
            self.value = os.path.join(self.dir, "notify")
        else:
            self.dir = None
            self.value = f"@vllm-actors-test-{uuid.uuid4().hex}"
        self.sock.bind(socket_address(self.value))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        """Every datagram received so far (accumulated in ``messages``)."""
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return self.messages

    def lines(self) -> list[str]:
        return [line for m in self.drain() for line in m.splitlines()]

    def close(self) -> None:
        self.sock.close()
        if self.dir:
            Path(self.value).unlink(missing_ok=True)
            os.rmdir(self.dir)


@pytest.fixture(params=["path", "abstract"])
def systemd(request: pytest.FixtureRequest) -> Iterator[FakeSystemd]:
    fake = FakeSystemd(request.param)
    yield fake
    fake.close()


def test_noop_without_notify_socket() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.ready() is False and n.status("x") is False and n.watchdog_interval is None
    assert n.start_watchdog() is None


def test_messages(systemd: FakeSystemd) -> None:
    n = Notifier({"NOTIFY_SOCKET": systemd.value})
    assert n.status("loading model\n(2 of 3)")
    assert n.ready()
    assert n.stopping()
    assert systemd.drain() == ["STATUS=loading model (2 of 3)", "READY=1",
                               "STOPPING=1"]
    n.close()


async def test_watchdog_pings_at_half_the_timeout(systemd: FakeSystemd) -> None:
    n = Notifier({"NOTIFY_SOCKET": systemd.value, "WATCHDOG_USEC": "100000"})
    assert n.watchdog_interval == pytest.approx(0.05)
    n.start_watchdog()
    deadline = time.monotonic() + 5
    while systemd.lines().count("WATCHDOG=1") < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await n.stop_watchdog()
    count = systemd.lines().count("WATCHDOG=1")
    await asyncio.sleep(0.15)
    assert systemd.lines().count("WATCHDOG=1") == count  # stopped means stopped


def test_watchdog_for_another_pid_stays_quiet(systemd: FakeSystemd) -> None:
    env = {"NOTIFY_SOCKET": systemd.value, "WATCHDOG_USEC": "100000"}
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval is None
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 0.05


class Probe:
    """A child that looks at what systemd has received while it starts and stops."""

    def __init__(self, name: str, systemd: FakeSystemd, seen: dict[str, list[str]]) -> None:
        self.name, self.systemd, self.seen = name, systemd, seen
        self._exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        await asyncio.sleep(0.05)  # slow start, like a model load
        self.seen[f"start:{self.name}"] = list(self.systemd.lines())

    async def wait(self) -> None:
        await self._exit

    async def stop(self, timeout: float | None) -> None:
        self.seen[f"stop:{self.name}"] = list(self.systemd.lines())
        if not self._exit.done():
            self._exit.set_result(None)


async def test_serve_root_ready_status_watchdog_stopping(systemd: FakeSystemd) -> None:
    seen: dict[str, list[str]] = {}
    root = Supervisor("root", [ChildSpec(n, (lambda n=n: Probe(n, systemd, seen)))
                               for n in ("nats", "frontend", "worker")])
    notifier = Notifier({"NOTIFY_SOCKET": systemd.value, "WATCHDOG_USEC": "100000"})
    stop = asyncio.Event()
    task = asyncio.create_task(serve_root(root, stop, notifier, shutdown_timeout=5))
    deadline = time.monotonic() + 5
    while "READY=1" not in systemd.lines():
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.01)
    # READY only after every child is up; STATUS lines while starting
    assert all("READY=1" not in seen[f"start:{n}"] for n in ("nats", "frontend", "worker"))
    assert "STATUS=root: starting worker" in seen["start:worker"]
    while systemd.lines().count("WATCHDOG=1") < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    stop.set()
    assert await asyncio.wait_for(task, 5) == 0
    # STOPPING is announced before the first child (the last started) is stopped
    assert "STOPPING=1" in seen["stop:worker"]
    assert seen["stop:worker"].index("STOPPING=1") > seen["stop:worker"].index("READY=1")


async def test_serve_root_exit_code_when_root_gives_up(systemd: FakeSystemd) -> None:
    class Crashy:
        name = "crashy"

        async def start(self) -> None:
            raise RuntimeError("no model")

        async def wait(self) -> None:  # pragma: no cover - never started
            return None

        async def stop(self, timeout: float | None) -> None:
            return None

    root = Supervisor("root", [ChildSpec("crashy", Crashy)], intensity=1,
                      backoff=Backoff(initial=0.01, jitter=0))
    notifier = Notifier({"NOTIFY_SOCKET": systemd.value})
    code = await asyncio.wait_for(serve_root(root, asyncio.Event(), notifier), 5)
    assert code == 1
    lines = systemd.lines()
    assert "READY=1" not in lines
    assert any(line.startswith("STATUS=failed to start") for line in lines)


async def test_serve_root_stops_during_a_slow_start(systemd: FakeSystemd) -> None:
    stopped: list[str] = []

    class Slow:
        name = "engine"

        async def start(self) -> None:
            await asyncio.sleep(600)  # a model that takes forever to load

        async def wait(self) -> None:  # pragma: no cover - never up
            return None

        async def stop(self, timeout: float | None) -> None:
            stopped.append("engine")

    root = Supervisor("root", [ChildSpec("engine", Slow)])
    stop = asyncio.Event()
    task = asyncio.create_task(serve_root(root, stop, Notifier({"NOTIFY_SOCKET": systemd.value}),
                                          shutdown_timeout=5))
    deadline = time.monotonic() + 5
    while "STATUS=root: starting engine" not in systemd.lines():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    stop.set()
    assert await asyncio.wait_for(task, 5) == 0
    assert stopped == ["engine"]  # the half-started child was killed
    lines = systemd.lines()
    assert "STOPPING=1" in lines and "READY=1" not in lines
