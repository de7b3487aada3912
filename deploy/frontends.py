"""The frontend as N OS processes (``frontend.processes`` > 1): the root binds the HTTP address once
(``HttpListener``), accepts on it and hands each connection to one of N ``actors.frontend.process``
children (``ConnectionDispatcher``; why: ``actors.frontend.handoff``), and keeps one more process
imported and idle as a warm standby for restarts (``FrontendProcesses``, ``Standby``).

Each process is a ``permanent`` child of the root, beside the workers: a SIGKILLed frontend process
is restarted alone (the root's strategy is one_for_one by default), while the root keeps
supervision, the control service and the embedded nats-server, and the other frontend processes
keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from actors.frontend.handoff import CONNECTION, READY, STOPPED
from bus.addresses import split_hostport
from config.topology import Topology
from config.workers import HANDOFF_FD_ENV, OVERRIDES_ENV, frontend_child_id, worker_overrides
from supervisors.child import Child, ChildSpec

if TYPE_CHECKING:
    from supervisors.process import ProcessChild

log = logging.getLogger(__name__)

BACKLOG = 1024
# a frontend process imports vLLM's tokenizer and parsers before it serves
READY_TIMEOUT = 60.0


class HttpListener:
    """The frontend's listening socket, bound on first use and held for the root's lifetime: a
    restarted frontend process is handed connections at once, and the address stays this deployment's."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock: socket.socket | None = None

    def socket(self) -> socket.socket:
        if self._sock is None:
            host, port = split_hostport(self.address)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
            self._sock.setblocking(False)
            log.info("frontend: listening on %s:%d, handing connections to the frontend processes", host,
                     self._sock.getsockname()[1])
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _Link:
    __slots__ = ("_name", "owner", "sock", "ready", "handed")

    def __init__(self, name: str, sock: socket.socket) -> None:
        self._name = name
        self.owner: ProcessChild | None = None  # the process child at this link's other end (a taken standby is renamed)
        self.sock = sock
        self.ready = False
        self.handed = 0

    @property
    def name(self) -> str:
        return self.owner.name if self.owner is not None else self._name


class ConnectionDispatcher:
    """Accepts on the frontend's address, in the root, and hands each connection to the next ready
    frontend process (round robin) over that process's Unix socket pair (``actors.frontend.handoff``
    says why). While no process is ready, the root accepts nothing: connections wait in the backlog."""

    ACCEPT_BATCH = 64  # connections accepted per wake-up, at most

    def __init__(self, listener: HttpListener) -> None:
        self.listener = listener
        self._links: list[_Link] = []
        self._next = 0
        self._accepting = False

    def pair(self, name: str) -> tuple[_Link, socket.socket]:
        """A new process's link: the root's end is watched from now on; the child's end is returned
        too (pass it to the process, then close it here)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        link = _Link(name, ours)
        self._links.append(link)
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_link, link)
        return link, theirs

    def _on_link(self, link: _Link) -> None:
        try:
            data = link.sock.recv(16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the process is gone
            self._drop(link)
        elif data.endswith(READY):
            link.ready = True
            log.debug("frontend: %s takes connections", link.name)
        elif data.endswith(STOPPED):
            link.ready = False
        self._update()

    def ready(self) -> int:
        """Processes that take connections now."""
        return sum(link.ready for link in self._links)

    def _drop(self, link: _Link) -> None:
        asyncio.get_running_loop().remove_reader(link.sock.fileno())
        link.sock.close()
        if link in self._links:
            self._links.remove(link)
        log.info("frontend: %s gone after %d connections; the other processes take new ones", link.name,
                 link.handed)

    def _update(self) -> None:
        want = any(link.ready for link in self._links)
        if want == self._accepting:
            return
        loop = asyncio.get_running_loop()
        fd = self.listener.socket().fileno()
        if want:
            loop.add_reader(fd, self._on_accept)
        else:
            loop.remove_reader(fd)
        self._accepting = want

    def _on_accept(self) -> None:
        sock = self.listener.socket()
        for _ in range(self.ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:  # out of descriptors: the backlog holds them meanwhile
                log.warning("frontend: cannot accept a connection: %s", e)
                return
            try:
                self._hand(conn)
            finally:
                conn.close()  # the process holds its own copy now (or the client sees a reset)

    def _hand(self, conn: socket.socket) -> None:
        ready = [link for link in self._links if link.ready]
        for _ in range(len(ready)):
            link = ready[self._next % len(ready)]
            self._next += 1
            try:
                socket.send_fds(link.sock, [CONNECTION], [conn.fileno()])
            except (BlockingIOError, InterruptedError):
                continue  # that process is not reading: the next one
            except OSError:
                link.ready = False  # gone: its EOF follows
                continue
            link.handed += 1
            return
        log.warning("frontend: no frontend process took a connection; it is closed")

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._accepting:
            loop.remove_reader(self.listener.socket().fileno())
            self._accepting = False
        for link in list(self._links):
            loop.remove_reader(link.sock.fileno())
            link.sock.close()
        self._links.clear()


def frontend_argv(topology_path: str | Path, index: int | None, supervisors: list[str]) -> list[str]:
    """``index`` None: a standby, which reads its index from stdin once it is needed."""
    return [sys.executable, "-m", "actors.frontend.process", "--topology", str(Path(topology_path).resolve()),
            *(["--index", str(index)] if index is not None else ["--standby"]),
            "--supervisors", ",".join(supervisors)]


class FrontendProcesses:
    """The frontend processes of a root: their command, environment and connection hand-over, and
    one warm standby.

    A frontend process spends seconds importing vLLM's request models, tokenizer and parsers (8.5 s
    on this 2-core box, idle) before it serves. So one process is always kept started and imported
    but idle (``frontend-standby``, a root child), and a frontend process that must (re)start takes
    it: it is told its index on stdin and serves within a second. Only when no standby is ready (the
    deployment's first start, two crashes in a row) does a process start cold."""

    def __init__(self, t: Topology, topology_path: str | Path, overrides: list[str], listener: HttpListener,
                 supervisors: list[str], on_status: Callable[[str], None]) -> None:
        self.t = t
        self.topology_path = topology_path
        self.dispatcher = ConnectionDispatcher(listener)
        self.supervisors = supervisors
        self.on_status = on_status
        self.env_overrides = json.dumps(worker_overrides(t, overrides))
        self.spare: ProcessChild | None = None
        self.taken = asyncio.Event()  # the standby was taken: make another

    def process(self, name: str, index: int | None) -> ProcessChild:
        from supervisors.process import ProcessChild
        self.dispatcher.listener.socket()  # bound before any process exists: a taken port fails this start
        link, theirs = self.dispatcher.pair(name)
        env = {OVERRIDES_ENV: self.env_overrides, HANDOFF_FD_ENV: str(theirs.fileno())}
        child = ProcessChild(name, frontend_argv(self.topology_path, index, self.supervisors), env=env,
                             ready_timeout=READY_TIMEOUT, on_status=self.on_status if index is not None else None,
                             pass_fds=lambda: [theirs.fileno()], on_spawned=theirs.close,
                             go=b"" if index is None else None)  # a standby's stdin: its index, once taken
        link.owner = child
        return child

    def take(self, name: str, index: int) -> ProcessChild:
        """The standby, told to be process ``index``; a cold process when none is alive."""
        spare, self.spare = self.spare, None
        self.taken.set()
        if spare is None or spare.returncode is not None:
            return self.process(name, index)
        spare.name, spare.go, spare.on_status = name, f"{index}\n".encode(), self.on_status
        return spare

    def specs(self) -> list[tuple[ChildSpec, str]]:
        """(child spec, description) of each frontend process, then of the standby."""
        out = []
        drain = self.t.supervisor.drain_timeout + 5.0  # drains its streams, as the in-process frontend does
        for i in range(self.t.frontend.processes):
            cid = frontend_child_id(i)

            def start(cid: str = cid, i: int = i) -> Child:
                return self.take(cid, i)

            argv = frontend_argv(self.topology_path, i, self.supervisors)
            out.append((ChildSpec(cid, start, "permanent", drain, parallel=True,
                                  meta={"role": "frontend", "index": str(i)}), " ".join(argv[1:])))
        out.append((ChildSpec("frontend-standby", lambda: Standby(self), "permanent", 5.0, parallel=True,
                              meta={"role": "frontend-standby"}),
                    " ".join(frontend_argv(self.topology_path, None, self.supervisors)[1:])))
        return out


class Standby:
    """The root child that keeps ``FrontendProcesses.spare`` filled: a standby is started once every
    frontend process serves, so that its imports do not slow theirs on the deployment's start, and
    again each time one is taken (checked each second, and at once when a process takes it)."""

    def __init__(self, pool: FrontendProcesses) -> None:
        self.pool = pool
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        pass  # filled by wait(), once the frontend processes serve

    @property
    def pid(self) -> int | None:
        """The standby process's pid, in the root's children view (a restart takes that process)."""
        spare = self.pool.spare
        return spare.pid if spare is not None and spare.returncode is None else None

    @property
    def status(self) -> str:
        """What the root's children view says of this child: whether a warm standby is there to
        take (a restart without one imports for ~8 s before it serves)."""
        spare = self.pool.spare
        if spare is None or spare.returncode is not None:
            return "no standby process (one starts once every frontend process serves)"
        return spare.status or "starting (importing)"

    async def wait(self) -> None:
        """Refill when the standby is taken; a standby that dies on its own is a crash of this child
        (its supervisor restarts it with backoff, and counts it)."""
        pool = self.pool
        while not self._stopped.is_set():
            spare = pool.spare
            if spare is not None and spare.returncode is not None:
                pool.spare = None
                await spare.stop(None)  # its notify socket and reader
                raise RuntimeError(f"the frontend standby (pid {spare.pid}) exited with {spare.returncode}")
            if spare is None and pool.dispatcher.ready() >= pool.t.frontend.processes:
                spare = pool.process("frontend-standby", None)
                await spare.spawn()
                pool.spare = spare
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.taken.wait(), 1.0)
            pool.taken.clear()

    async def stop(self, timeout: float | None) -> None:
        self._stopped.set()
        spare, self.pool.spare = self.pool.spare, None
        if spare is not None:
            await spare.stop(None)  # idle: nothing to drain
