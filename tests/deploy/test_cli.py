"""``python -m actors.supervisor``: --check, --emit-systemd, and booting real trees as subprocesses
(embedded nats-server on a free port, a fake NOTIFY_SOCKET, SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import pytest

from bus.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]
ECHO = ROOT / "topologies" / "echo.toml"
PY = sys.executable
BOOT_TIMEOUT = 30.0  # generous: the test machine is shared; nothing asserts on speed


def cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "actors.supervisor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


# --- no boot ------------------------------------------------------------------------------------


def test_check_prints_resolved_tree() -> None:
    r = cli(str(ECHO), "--check", "--set", "bus.port=4555", "--set", "supervisor.intensity=3")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == f"{ECHO}: namespace echo, bus embedded nats-server on 127.0.0.1:4555"
    assert out[1].startswith("host local: supervisor local (one_for_one, intensity 3/60s")
    assert out[2].startswith("  - nats [permanent, shutdown 10s] nats: embedded nats-server 127.0.0.1:4555")
    assert out[3].startswith("  - inproc [permanent] supervisor (rest_for_one, intensity 3/60s")
    assert [line.split()[1] for line in out[4:]] == ["bus", "control", "echo"]


def test_check_lists_workers_per_host_and_frontend(tmp_path: Path) -> None:
    topo = tmp_path / "t.toml"
    topo.write_text('namespace = "n"\n[bus]\nurl = "nats://10.0.0.1:4222"\n[model]\nname = "m"\npath = "tiny"\n'
                    '[pools.dec]\nrole = "decode"\nengine = "mocker"\nreplicas = 2\nhost = "gpu"\n'
                    '[pools.pre]\nrole = "prefill"\nengine = "mocker"\nhost = "gpu"\n')
    r = cli(str(topo), "--check", "--host", "gpu")
    assert r.returncode == 0, r.stderr
    workers = [line for line in r.stdout.splitlines() if "] process: " in line]
    assert [w.split()[1] for w in workers] == ["worker-dec-0", "worker-dec-1", "worker-pre-0"]
    assert f"-m actors.worker.process --topology {topo} --pool dec --replica 1" in workers[1]
    assert "nats" not in [line.split()[1] for line in r.stdout.splitlines()[2:]]  # bus.url: no embedding
    r = cli(str(topo), "--check")
    assert "host local: " in r.stdout and "] actor: FrontendActor http://127.0.0.1:8000/v1" in r.stdout


def test_check_lists_the_frontend_processes_and_their_standby() -> None:
    topo = ROOT / "topologies" / "mocker-agg.toml"
    r = cli(str(topo), "--check", "--set", "frontend.processes=3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    ids = [line.split()[1] for line in lines if line.startswith("  - ")]
    assert ids == ["nats", "inproc", "frontend-0", "frontend-1", "frontend-2", "frontend-standby", "worker-agg-0"]
    inproc = [line.split()[1] for line in lines if line.startswith("      - ")]
    # the frontend left the root process; the root's waker (cold pools, no planner) stays in it
    assert inproc == ["bus", "control", "waker"]
    assert f"-m actors.frontend.process --topology {topo} --index 2 --supervisors local" in r.stdout
    assert f"-m actors.frontend.process --topology {topo} --standby --supervisors local" in r.stdout
    r = cli(str(topo), "--check", "--set", "frontend.processes=0")
    assert r.returncode == 2 and "frontend.processes: expected 1..64 processes, got 0" in r.stderr


def test_check_bad_topology_exits_2_with_the_error() -> None:
    bad = "tests/fixtures/topologies/bad_replicas_zero.toml"
    r = cli(bad, "--check")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {bad}: pools.decode.replicas: expected int >= 1, got 0"
    assert r.stdout == ""


def test_unknown_host_exits_2() -> None:
    r = cli(str(ECHO), "--host", "elsewhere")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --host: 'elsewhere' is not a host of this topology (hosts: local)"


def test_emit_systemd(tmp_path: Path) -> None:
    r = cli(str(ECHO), "--emit-systemd", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "vllm-actors-echo-nats.service"),
                                str(tmp_path / "vllm-actors-echo-local.service")]


# --- booting ------------------------------------------------------------------------------------


class NotifySocket:
    """A fake systemd: collects sd_notify datagrams."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []
        self._new = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 65536)
            self.messages.extend(data.decode().splitlines())
            self._new.set()

    async def wait_for(self, line: str, timeout: float = BOOT_TIMEOUT) -> int:
        """Index of the first message equal to ``line``."""
        async def poll() -> int:
            while line not in self.messages:
                self._new.clear()
                await self._new.wait()
            return self.messages.index(line)
        return await asyncio.wait_for(poll(), timeout)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close()


class Boot:
    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc, self.log = proc, log

    @classmethod
    async def start(cls, tmp: Path, *args: str, env: dict[str, str] | None = None, tag: str = "sup") -> Boot:
        log = tmp / f"{tag}.log"
        with open(log, "wb") as out:
            proc = await asyncio.create_subprocess_exec(
                PY, "-m", "actors.supervisor", *args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})})
        return cls(proc, log)

    async def terminate(self, timeout: float = BOOT_TIMEOUT) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
async def boots() -> AsyncIterator[list[Boot]]:
    started: list[Boot] = []
    yield started
    for b in reversed(started):  # never leave a supervisor (and its nats-server) behind
        with contextlib.suppress(Exception):
            await b.terminate(10)
        await b.kill()


async def request(nc: nats.NATS, subject: str, payload: dict[str, object]) -> dict[str, object]:
    msg = await nc.request(subject, json.dumps(payload).encode(), timeout=5)
    assert not (msg.headers or {}).get("Nats-Service-Error"), msg.headers
    return json.loads(msg.data)


async def children(nc: nats.NATS, ns: str, host: str) -> dict[str, dict[str, object]]:
    """Flattened child views from the supervisor's micro service (nested supervisors included)."""
    view = await request(nc, f"{ns}.supervisor.{host}.children", {})
    out: dict[str, dict[str, object]] = {}

    def walk(kids: list[dict[str, object]]) -> None:
        for k in kids:
            out[str(k["id"])] = k
            walk(k.get("children", []))  # type: ignore[arg-type]
    walk(view["children"])  # type: ignore[arg-type]
    return out


async def test_boot_echo_notify_crash_restart_and_sigterm(tmp_path: Path, boots: list[Boot]) -> None:
    port = free_port()
    fake = NotifySocket(tmp_path / "notify")
    try:
        b = await Boot.start(tmp_path, str(ECHO), "--set", f"bus.port={port}", "--set", f"run_dir={tmp_path}",
                             env={"NOTIFY_SOCKET": str(fake.path), "WATCHDOG_USEC": "400000"})
        boots.append(b)
        ready = await fake.wait_for("READY=1")
        # STATUS lines came while the children were starting, before READY
        assert any(m.startswith("STATUS=") and "starting" in m for m in fake.messages[:ready])
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            # READY=1 means every child is up: no retry needed for the first request
            reply = await request(nc, "echo.echo.echo", {"message": "hi"})
            assert reply == {"message": "hi", "instance": "local"}
            kids = await children(nc, "echo", "local")
            assert {k: v["state"] for k, v in kids.items()} == {
                "nats": "running", "inproc": "running", "bus": "running", "control": "running",
                "echo": "running"}
            assert "WATCHDOG=1" in fake.messages

            # a crashing echo actor is restarted by its supervisor
            assert (await request(nc, "echo.echo.crash", {"reason": "test"}))["status"] == "crashing"
            for _ in range(100):
                kids = await children(nc, "echo", "local")
                if kids["echo"]["restarts"] == 1 and kids["echo"]["state"] == "running":
                    break
                await asyncio.sleep(0.1)
            assert kids["echo"]["restarts"] == 1 and kids["echo"]["state"] == "running"
            assert "EchoCrash: test" in str(kids["echo"]["last_exit_reason"])
            assert (await request(nc, "echo.echo.echo", {"message": "again"}))["message"] == "again"
            assert kids["nats"]["restarts"] == 0 and kids["bus"]["restarts"] == 0
        finally:
            await nc.close()

        assert await b.terminate() == 0, b.output()
        await fake.wait_for("STOPPING=1", 5)
        out = b.output()
        # reverse start order: echo before the connection, nats-server last
        assert out.index("child echo stopped") < out.index("child bus stopped") < out.index("child nats stopped")
        with pytest.raises(OSError):  # the embedded server is gone with it
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    finally:
        await fake.close()


async def test_two_supervisors_share_one_nats_with_host(tmp_path: Path, boots: list[Boot]) -> None:
    port = free_port()
    topo = tmp_path / "two.toml"
    topo.write_text('namespace = "duo"\necho = true\necho_hosts = ["a", "b"]\n'
                    f'run_dir = "{tmp_path}"\n[bus]\nport = {port}\n[frontend]\nenabled = false\n')
    fa, fb = NotifySocket(tmp_path / "na"), NotifySocket(tmp_path / "nb")
    try:
        a = await Boot.start(tmp_path, str(topo), "--host", "a", env={"NOTIFY_SOCKET": str(fa.path)}, tag="a")
        boots.append(a)
        await fa.wait_for("READY=1")
        # the second supervisor joins the first one's server instead of embedding its own
        b = await Boot.start(tmp_path, str(topo), "--host", "b", "--set", f"bus.url=nats://127.0.0.1:{port}",
                             env={"NOTIFY_SOCKET": str(fb.path)}, tag="b")
        boots.append(b)
        await fb.wait_for("READY=1")
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            assert set(await children(nc, "duo", "a")) == {"nats", "inproc", "bus", "control", "echo"}
            assert set(await children(nc, "duo", "b")) == {"inproc", "bus", "control", "echo"}
            seen = set()
            for _ in range(50):  # both echo instances serve the same queue group
                seen.add((await request(nc, "duo.echo.echo", {"message": "x"}))["instance"])
                if seen == {"a", "b"}:
                    break
            assert seen == {"a", "b"}
        finally:
            await nc.close()
        assert await b.terminate() == 0, b.output()
        assert await a.terminate() == 0, a.output()
        assert "starting embedded nats-server" not in b.output()
    finally:
        await fa.close()
        await fb.close()


async def test_root_giving_up_exits_non_zero(tmp_path: Path, boots: list[Boot]) -> None:
    """Crash the echo actor until ``inproc`` exceeds its intensity twice: the root (intensity 1)
    gives up, says so to systemd and exits 1 (so Restart=on-failure restarts the host)."""
    port = free_port()
    fake = NotifySocket(tmp_path / "notify")
    b = await Boot.start(tmp_path, str(ECHO), "--set", f"bus.port={port}", "--set", f"run_dir={tmp_path}",
                         "--set", "supervisor.intensity=1", "--set", "supervisor.backoff.initial=0.05",
                         "--set", "supervisor.backoff.max=0.1", env={"NOTIFY_SOCKET": str(fake.path)})
    boots.append(b)
    try:
        await fake.wait_for("READY=1")
        nc = await nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=-1,
                                reconnect_time_wait=0.1)
        try:
            async def crash_until_exit() -> int:
                while b.proc.returncode is None:
                    with contextlib.suppress(Exception):
                        await nc.request("echo.echo.crash", b"{}", timeout=0.5)
                    await asyncio.sleep(0.05)
                return b.proc.returncode
            rc = await asyncio.wait_for(crash_until_exit(), BOOT_TIMEOUT)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        assert rc == 1, b.output()
        assert "supervisor local: more than 1 restarts in 60s; last: child inproc" in b.output()
        assert "STOPPING=1" in fake.messages
    finally:
        await fake.close()


async def test_sigterm_while_starting_stops_promptly_with_0(tmp_path: Path, boots: list[Boot]) -> None:
    """No server at bus.url: the connection child is still trying when SIGTERM arrives."""
    fake = NotifySocket(tmp_path / "notify")
    b = await Boot.start(tmp_path, str(ECHO), "--set", f"bus.url=nats://127.0.0.1:{free_port()}",
                         env={"NOTIFY_SOCKET": str(fake.path)})
    boots.append(b)
    try:
        await fake.wait_for("STATUS=local/inproc: starting bus")
        assert await b.terminate(10) == 0, b.output()
        assert "STOPPING=1" in fake.messages and "READY=1" not in fake.messages
    finally:
        await fake.close()


async def test_worker_process_child_is_restarted_after_sigkill(tmp_path: Path, boots: list[Boot]) -> None:
    """A mocker pool: each replica is an OS process under the root; SIGKILL → restarted."""
    port = free_port()
    b = await Boot.start(tmp_path, str(ROOT / "topologies" / "mocker-agg.toml"), "--set", f"bus.port={port}",
                         "--set", f"run_dir={tmp_path}", "--set", "frontend.enabled=false",
                         "--set", "pools.agg.replicas=2", "--set", "supervisor.backoff.initial=0.1")
    boots.append(b)
    nc = await nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        async def until(pred: Callable[[dict[str, dict[str, object]]], bool]) -> dict[str, dict[str, object]]:
            for _ in range(int(BOOT_TIMEOUT / 0.2)):
                with contextlib.suppress(Exception):
                    kids = await children(nc, "dynamo", "local")
                    if pred(kids):
                        return kids
                await asyncio.sleep(0.2)
            raise AssertionError(f"condition not reached; log:\n{b.output()[-3000:]}")

        kids = await until(lambda k: all(k.get(f"worker-agg-{i}", {}).get("state") == "running" for i in (0, 1)))
        pid = int(kids["worker-agg-1"]["pid"])  # type: ignore[arg-type]
        os.kill(pid, signal.SIGKILL)
        kids = await until(lambda k: k["worker-agg-1"]["restarts"] == 1 and k["worker-agg-1"]["state"] == "running")
        assert kids["worker-agg-1"]["pid"] != pid
        assert "SIGKILL" in str(kids["worker-agg-1"]["last_exit_reason"])
        assert kids["worker-agg-0"]["restarts"] == 0  # one_for_one: the sibling is untouched
    finally:
        await nc.close()
    assert await b.terminate() == 0, b.output()
