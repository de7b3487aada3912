"""Serving HTTP connections that the root process accepted and handed over (``frontend.processes`` > 1).

The root binds the frontend's address and accepts every connection itself, then passes each one
(its descriptor, over a Unix socket pair: SCM_RIGHTS) to a frontend process in turn
(``deploy.frontends.ConnectionDispatcher``). This process serves what it is handed and says when it
is ready for more (one byte, ``READY``). Why not every process accepting from one shared socket, or
SO_REUSEPORT:
- a shared socket is won by whichever process wakes first: measured here, bursts of 64 new
  connections split 57/7 between two idle processes, so one process did the work of two;
- SO_REUSEPORT balances by a hash, but any process of the same user may join the group (a second
  deployment started on the same port would silently take half of this one's connections) and
  the connections queued on a SIGKILLed process's socket are reset;
- with the root accepting, the address stays exclusive (a second deployment fails to bind, loudly),
  connections wait in the root's backlog while no process is ready, a killed process loses only
  the connections it was serving, and the split is exact (round robin over the ready processes).
The cost: one accept and one descriptor hand-over in the root per connection (not per request:
keep-alive connections are handed once).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

READY = b"R"  # process -> root: serving, send connections
STOPPED = b"S"  # process -> root: send no more (its frontend actor stopped; a restart sends READY)
CONNECTION = b"C"  # root -> process: one connection, its descriptor attached
MAX_FDS = 64  # descriptors read per message batch


class HandedConnections:
    """Receives connections on ``link`` (this process's end of a SOCK_SEQPACKET pair with the root)
    and hands each one to ``factory`` (an aiohttp server: a protocol factory)."""

    def __init__(self, link: socket.socket, factory: Callable[[], asyncio.Protocol],
                 on_lost: Callable[[], None] | None = None) -> None:
        self.link = link
        self.factory = factory
        self.on_lost = on_lost  # the root closed its end (it is gone): this process cannot serve
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[asyncio.Task[object]] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.link.setblocking(False)
        self._loop.add_reader(self.link.fileno(), self._on_readable)
        self.link.send(READY)

    def _on_readable(self) -> None:
        assert self._loop is not None
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.link, 16, MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.error("frontend: connection hand-over from the root failed: %s", e)
            data, fds = b"", []
        if not data and not fds:
            self._loop.remove_reader(self.link.fileno())
            log.error("frontend: the root closed the connection hand-over; no new connections arrive")
            if self.on_lost is not None:
                self.on_lost()
            return
        for fd in fds:
            conn = socket.socket(fileno=fd)
            conn.setblocking(False)
            task = self._loop.create_task(self._connect(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(self.factory, conn)
        except Exception as e:  # noqa: BLE001 - one connection lost, not the hand-over
            log.debug("frontend: handed connection dropped: %s", e)
            conn.close()

    def stop(self) -> None:
        """Take no more connections (the link stays open: a restarted actor in this process serves
        it again; the process's exit closes it, which the root sees at once)."""
        if self._loop is not None:
            self._loop.remove_reader(self.link.fileno())
        for task in self._pending:
            task.cancel()
        try:
            self.link.send(STOPPED)
        except OSError as e:  # the root is gone
            log.debug("frontend: hand-over stop not sent: %s", e)
