"""ProcessChild: a Child that is an OS process (a worker is one OS process).

Readiness uses the sd_notify protocol: the parent binds a unix datagram socket in the abstract
namespace, passes it as NOTIFY_SOCKET, and start() returns when the child sends READY=1 (the child
uses supervisors.sdnotify.Notifier, exactly as it would under systemd). STATUS lines are logged,
kept in ``status`` and passed to ``on_status`` (a supervisor shows them while the child starts).

The process runs in its own session/process group so stop() can signal the whole group (vLLM spawns
helper processes), and it gets PR_SET_PDEATHSIG=SIGKILL so it dies with the supervisor instead of
becoming an orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal

from bus.errors import FatalError
from supervisors.child import Misconfigured, NormalExit

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# A child process that has done its job for good exits with this code (e.g. a worker whose
# checkpoint snapshot was taken); a parent that lists it in ``normal_exit_codes`` does not restart
# it. Apart from Python's 1 (uncaught exception) and 2 (usage), and from 126+ (a shell's "cannot
# run" and 128+N "killed by signal N").
EXIT_DONE = 3
# A child process whose configuration is rejected (a restart would fail the same way) exits with
# this code (sysexits' EX_CONFIG); its last STATUS says what was rejected. ProcessChild reports it
# as ``Misconfigured``, which a supervisor does not restart forever.
EXIT_CONFIG = 78


class ProcessExited(FatalError):
    """The process exited abnormally; ``returncode`` is negative for a signal (as in subprocess)."""

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _die_with_parent(parent_pid: int) -> None:
    """preexec_fn (runs in the child between fork and exec): SIGKILL when the parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # non-Linux: the stop() path still cleans up
        return
    # the parent may have died before prctl took effect
    if os.getppid() != parent_pid:
        os._exit(1)


class ProcessChild:
    """Run ``argv`` as a supervised OS process."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 inherit_env: bool = True, cwd: str | None = None, log_file: str | None = None,
                 ready: Literal["notify", "spawn"] = "notify", ready_timeout: float = 120.0,
                 normal_exit_codes: Collection[int] = (0,),
                 on_status: Callable[[str], None] | None = None,
                 pass_fds: Callable[[], Sequence[int]] | None = None, go: bytes | None = None,
                 on_spawned: Callable[[], None] | None = None) -> None:
        """``normal_exit_codes``: return codes that count as a normal exit, not a crash (0 always
        does), so a transient child is not restarted; a code other than 0 is reported with the
        child's last STATUS line, which says why it ended. ``pass_fds``: descriptors the child
        inherits (under the same numbers), asked for at each start (a socket the parent
        holds, e.g.). ``go``: the process's stdin is a pipe, and ``start`` writes what ``go`` holds
        then (set it before): for a process spawned ahead of time (``spawn``) that waits for it (a
        warm standby). ``on_spawned``: called once the process exists (to close this side's copies
        of what ``pass_fds`` gave it)."""
        if not argv:
            raise ValueError("ProcessChild needs a non-empty argv")
        self.name = name
        self.argv = list(argv)
        self.env = dict(env or {})
        self.inherit_env = inherit_env
        self.cwd = cwd
        self.log_file = log_file
        self.ready = ready
        self.ready_timeout = ready_timeout
        self.normal_exit_codes = frozenset(normal_exit_codes)
        self.proc: asyncio.subprocess.Process | None = None
        self.status: str | None = None  # last STATUS= line the child sent
        self.on_status = on_status
        self.pass_fds = pass_fds
        self.go = go
        self.on_spawned = on_spawned
        self._went = False
        self._sock: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._stop_requested = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    async def spawn(self) -> None:
        """Start the OS process without waiting for it to be ready. With ``go``, the process waits
        for that line on its stdin (a warm standby, ``start`` sends it); otherwise ``start`` calls
        this itself."""
        if self.proc is not None:
            raise RuntimeError(f"process child {self.name} already started")
        env = dict(os.environ) if self.inherit_env else {}
        env.update(self.env)
        env.pop("WATCHDOG_USEC", None)  # systemd's watchdog is ours, not the child's
        env.pop("WATCHDOG_PID", None)
        if self.ready == "notify":
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            name = f"vllm-actors/{os.getpid()}/{uuid.uuid4().hex}"
            self._sock.bind(b"\0" + name.encode())
            self._sock.setblocking(False)
            env["NOTIFY_SOCKET"] = "@" + name
        else:
            env.pop("NOTIFY_SOCKET", None)
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 (closed below)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, env=env, cwd=self.cwd,
                stdin=asyncio.subprocess.PIPE if self.go is not None else asyncio.subprocess.DEVNULL,
                stdout=out, stderr=asyncio.subprocess.STDOUT if out else None,
                start_new_session=True, preexec_fn=lambda p=os.getpid(): _die_with_parent(p),
                pass_fds=tuple(self.pass_fds()) if self.pass_fds is not None else ())
        except Exception:
            self._close_sock()
            raise
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor
            if self.on_spawned is not None:
                self.on_spawned()
        log.info("process %s started: pid %d: %s", self.name, self.proc.pid, " ".join(self.argv))
        if self._sock is not None:
            self._reader = asyncio.create_task(self._read_notify(), name=f"notify:{self.name}")

    async def start(self) -> None:
        if self.proc is None:
            await self.spawn()
        elif self._went:
            raise RuntimeError(f"process child {self.name} already started")
        assert self.proc is not None
        self._went = True
        if self.go is not None and self.proc.stdin is not None:
            self.proc.stdin.write(self.go)
            with contextlib.suppress(ConnectionError):
                await self.proc.stdin.drain()
            self.proc.stdin.close()
        if self._sock is None:
            return
        # ready or exited, whichever comes first: the loser is cancelled, and the group makes sure
        # neither waiter outlives this start (nor a cancellation of it)
        async with asyncio.TaskGroup() as race:
            exited = race.create_task(self.proc.wait())
            ready = race.create_task(self._ready.wait())
            done, _ = await asyncio.wait({exited, ready}, timeout=self.ready_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            exited.cancel()
            ready.cancel()
        if ready in done and self._ready.is_set():
            log.info("process %s (pid %d) ready", self.name, self.proc.pid)
            return
        if self.proc.returncode is not None:
            await self._drain_notify()
            await self._cleanup()
            self._raise_if_normal(self.proc.returncode)
            # its last STATUS says why (a worker's "failed to start: <the engine's error>")
            said = f": {self.status}" if self.status else ""
            self._raise_if_misconfigured(self.proc.returncode, f" before ready{said}")
            raise ProcessExited(f"process {self.name} {exit_reason(self.proc.returncode)} before "
                                f"ready{said}", self.proc.returncode)
        await self.stop(None)
        raise TimeoutError(f"process {self.name} not ready within {self.ready_timeout:g}s")

    def _report(self, status: str) -> None:
        if self.on_status is None:
            return
        try:
            self.on_status(status)
        except Exception:  # a listener's bug must not stop readiness from being read
            log.exception("process %s: on_status callback failed", self.name)

    async def _read_notify(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            self._on_notify(await loop.sock_recv(self._sock, 4096))

    def _on_notify(self, data: bytes) -> None:
        for line in data.decode(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key == "READY" and value == "1":
                self._ready.set()
            elif key == "STATUS":
                self.status = value
                log.info("process %s: %s", self.name, value)
                self._report(value)
            elif key == "STOPPING" and value == "1":
                log.info("process %s is stopping", self.name)

    async def _drain_notify(self) -> None:
        """Read what the process sent just before it exited (its last STATUS says why it ended)."""
        await asyncio.sleep(0)  # a datagram the reader already received is handled before it is cancelled
        while self._sock is not None:
            try:
                data = self._sock.recv(4096)
            except (BlockingIOError, OSError):
                return
            self._on_notify(data)

    async def wait(self) -> None:
        if self.proc is None:
            raise RuntimeError(f"process child {self.name} not started")
        rc = await self.proc.wait()
        self._signal_group(signal.SIGKILL)  # no helper of a dead leader may linger
        await self._drain_notify()
        await self._cleanup()
        if self._stop_requested or rc == 0:
            return
        self._raise_if_normal(rc)
        self._raise_if_misconfigured(rc, f": {self.status}" if self.status else "")
        raise ProcessExited(f"process {self.name} (pid {self.proc.pid}) {exit_reason(rc)}", rc)

    def _raise_if_normal(self, rc: int) -> None:
        if rc != 0 and rc in self.normal_exit_codes:
            raise NormalExit(f"{exit_reason(rc)}: {self.status}" if self.status else exit_reason(rc))

    def _raise_if_misconfigured(self, rc: int, said: str) -> None:
        if rc == EXIT_CONFIG:
            raise Misconfigured(f"process {self.name} {exit_reason(rc)} (configuration rejected){said}")

    async def stop(self, timeout: float | None) -> None:
        """SIGTERM the process group, SIGKILL after ``timeout`` (at once when None)."""
        self._stop_requested = True
        if self.proc is None:
            return
        if self.proc.returncode is None:
            if timeout is None or timeout <= 0:
                self._signal_group(signal.SIGKILL)
            else:
                self._signal_group(signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
                except TimeoutError:
                    log.warning("process %s (pid %d) ignored SIGTERM for %.1fs; SIGKILL",
                                self.name, self.proc.pid, timeout)
                    self._signal_group(signal.SIGKILL)
            await self.proc.wait()
        # helpers the leader spawned may outlive it: the group must go too
        self._signal_group(signal.SIGKILL)
        await self._cleanup()
        log.info("process %s (pid %d) stopped: %s", self.name, self.proc.pid,
                 exit_reason(self.proc.returncode or 0))

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)

    async def _cleanup(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        self._close_sock()

    def _close_sock(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
