"""Serving HTTP from a listening socket that several frontend processes share.

With ``frontend.processes`` > 1 the root process binds the HTTP address once and every frontend
process inherits that one socket (``deploy.frontends``). Why one socket and not SO_REUSEPORT:
- the address stays exclusive: a second deployment started on the same port fails loudly instead
  of silently joining the group and taking half of the other's connections;
- the kernel's one accept queue outlives a frontend process: a SIGKILLed process loses only the
  connections it had accepted; with SO_REUSEPORT, connections queued on its own socket are reset;
- a restarted process accepts at once, with no bind race, and ``http = "host:0"`` works.

The cost is balance: every process is woken for each new connection and one wins. asyncio (and
uvloop) accept up to the backlog at each wake-up, so the first process awake would take a whole
burst of connections. Here a process accepts one connection per turn of its loop: a busy process
turns its loop slower and takes fewer, an idle one takes more, which balances by load rather than
by hash.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

# after running out of descriptors (EMFILE...), the socket stays readable: pause accepting this long
PAUSE_ON_EXHAUSTION = 0.5


class SharedAccept:
    """Accepts from ``sock`` (listening, shared with other processes), one connection per loop turn,
    and hands each one to ``factory`` (an aiohttp server: a protocol factory)."""

    def __init__(self, sock: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        self.sock = sock
        self.factory = factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[asyncio.Task[object]] = set()
        self._resume: asyncio.TimerHandle | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # O_NONBLOCK is shared with every holder of this descriptor: harmless, none blocks on it
        self.sock.setblocking(False)
        self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        assert self._loop is not None
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another process took it
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("frontend: cannot accept a connection (%s); pausing %.1fs", e, PAUSE_ON_EXHAUSTION)
                self._loop.remove_reader(self.sock.fileno())
                self._resume = self._loop.call_later(PAUSE_ON_EXHAUSTION, self.start)
                return
            raise
        conn.setblocking(False)
        task = self._loop.create_task(self._connect(conn))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(self.factory, conn)
        except Exception as e:  # noqa: BLE001 - one connection lost, not the listener
            log.debug("frontend: accepted connection dropped: %s", e)
            conn.close()

    def stop(self) -> None:
        """Stop accepting (the socket stays open: the root and the other processes hold it)."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        for task in self._pending:
            task.cancel()
