"""systemd's sd_notify protocol, without libsystemd.

A datagram of newline-separated ``KEY=VALUE`` lines sent to the unix socket named by
``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). Everything is a no-op when the
variable is unset, so the same code runs under systemd, under our own ProcessChild (which uses this
protocol for readiness) and in a terminal.

``serve_root`` ties a root Supervisor to it: STATUS lines while starting, READY=1 once every child
is up, WATCHDOG=1 at half of WATCHDOG_USEC, STOPPING=1 before shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping

from supervisors.child import Misconfigured
from supervisors.process import EXIT_CONFIG
from supervisors.supervisor import Supervisor

log = logging.getLogger(__name__)


def socket_address(value: str) -> str | bytes:
    """NOTIFY_SOCKET value → address for sendto; '@name' is the abstract namespace (leading NUL)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET") or ""
        self.address: str | bytes | None = socket_address(raw) if raw else None
        self._sock: socket.socket | None = None
        self._warned = False
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        self.watchdog_usec: int | None = None
        # WATCHDOG_PID names the process systemd expects pings from; another pid must stay quiet
        if usec and usec.isdigit() and int(usec) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_usec = int(usec)
        self._watchdog_task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings: half the watchdog timeout, as sd_watchdog_enabled(3) advises."""
        return None if self.watchdog_usec is None or not self.enabled else self.watchdog_usec / 2e6

    def notify(self, *lines: str) -> bool:
        """Send one datagram; True when sent. Never raises: losing a notification must not crash
        the service (systemd would then time it out, which is the right signal)."""
        if self.address is None:
            return False
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(payload, self.address)
            return True
        except OSError as e:
            if not self._warned:
                log.warning("sd_notify to %r failed: %s", self.address, e)
                self._warned = True
            return False

    def ready(self, status: str | None = None) -> bool:
        lines = ["READY=1"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.notify(*lines)

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        lines = ["STOPPING=1"] + ([f"STATUS={_one_line(status)}"] if status else [])
        return self.notify(*lines)

    def start_watchdog(self) -> asyncio.Task[None] | None:
        """Start pinging at half of WATCHDOG_USEC (None when no watchdog is configured)."""
        interval = self.watchdog_interval
        if interval is None or self._watchdog_task is not None:
            return self._watchdog_task
        self._watchdog_task = asyncio.create_task(self._ping(interval), name="sd-watchdog")
        return self._watchdog_task

    async def stop_watchdog(self) -> None:
        task, self._watchdog_task = self._watchdog_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _ping(self, interval: float) -> None:
        # ping right away: systemd arms the watchdog at READY (or start), not at our first ping
        while True:
            self.watchdog()
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(text: str) -> str:
    return " ".join(text.split())


async def serve_root(root: Supervisor, stop: asyncio.Event, notifier: Notifier | None = None,
                     shutdown_timeout: float = 30.0) -> int:
    """Run ``root`` under systemd conventions until ``stop`` is set or the root gives up.

    Returns the process exit code: 0 after a requested shutdown, 1 when the root failed (so
    systemd's Restart=on-failure restarts the host), EXIT_CONFIG when it failed because a child's
    configuration is rejected (``Misconfigured``: a worker process's parent then stops retrying it).
    """
    notifier = notifier or Notifier()
    previous = root.on_status
    def on_status(text: str) -> None:
        notifier.status(text)
        if previous is not None:
            previous(text)
    root.on_status = on_status
    # the watchdog runs while starting too: model loading can outlast WatchdogSec
    notifier.start_watchdog()
    stopper = asyncio.create_task(stop.wait())
    try:
        # a SIGTERM while models load must not wait for the load to finish
        starter = asyncio.create_task(root.start())
        await asyncio.wait({starter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starter.done():
            notifier.stopping("shutting down while starting")
            await root.stop(shutdown_timeout)  # ends start() too
            with contextlib.suppress(Exception):
                await starter
            return 0
        if starter.exception() is not None:
            log.error("root supervisor %s failed to start: %s", root.name, starter.exception())
            notifier.status(f"failed to start: {starter.exception()}")
            return _failed(starter.exception())
        notifier.ready(f"{root.name}: all children up")
        waiter = asyncio.create_task(root.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if waiter.done():
            exc = waiter.exception()
            if exc is not None:
                log.error("root supervisor %s gave up: %s", root.name, exc)
                notifier.stopping(f"failed: {exc}")
                return _failed(exc)
            notifier.stopping("root stopped")
            return 0
        notifier.stopping("shutting down")
        await root.stop(shutdown_timeout)
        with contextlib.suppress(Exception):
            await waiter
        return 0
    finally:
        stopper.cancel()
        await notifier.stop_watchdog()
        root.on_status = previous
        notifier.close()


def _failed(exc: BaseException | None) -> int:
    return EXIT_CONFIG if isinstance(exc, Misconfigured) else 1
