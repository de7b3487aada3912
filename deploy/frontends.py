"""The frontend as N OS processes (``frontend.processes`` > 1): the root binds the HTTP address once
(``HttpListener``) and supervises N ``actors.frontend.process`` children that inherit it.

Each process is a ``permanent`` child of the root, beside the workers: a SIGKILLed frontend process
is restarted alone (the root's strategy is one_for_one by default), while the root keeps
supervision, the control service and the embedded nats-server, and the other frontend processes
keep serving from the same socket. Why one inherited socket rather than SO_REUSEPORT:
``actors.frontend.shared_socket``.
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

from config.topology import Topology
from config.workers import HTTP_FD_ENV, OVERRIDES_ENV, worker_overrides
from supervisors.child import Child, ChildSpec

if TYPE_CHECKING:
    from supervisors.process import ProcessChild

log = logging.getLogger(__name__)

BACKLOG = 1024
# a frontend process imports vLLM's tokenizer and parsers before it serves
READY_TIMEOUT = 60.0


class HttpListener:
    """The frontend's listening socket, bound on first use and held for the root's lifetime: a
    restarted frontend process accepts from it at once, and the address stays this deployment's."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock: socket.socket | None = None

    def socket(self) -> socket.socket:
        if self._sock is None:
            host, _, port = self.address.rpartition(":")
            host = host.strip("[]") or "0.0.0.0"
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._sock = socket.create_server((host, int(port)), family=family, backlog=BACKLOG)
            log.info("frontend: listening on %s:%d for %s", host, self._sock.getsockname()[1],
                     "the frontend processes")
        return self._sock

    def fd(self) -> int:
        return self.socket().fileno()

    @property
    def port(self) -> int | None:
        return int(self._sock.getsockname()[1]) if self._sock is not None else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def frontend_argv(topology_path: str | Path, index: int | None, supervisors: list[str]) -> list[str]:
    """``index`` None: a standby, which reads its index from stdin once it is needed."""
    return [sys.executable, "-m", "actors.frontend.process", "--topology", str(Path(topology_path).resolve()),
            *(["--index", str(index)] if index is not None else ["--standby"]),
            "--supervisors", ",".join(supervisors)]


class FrontendProcesses:
    """The frontend processes of a root: their command, environment and inherited socket, and one
    warm standby.

    A frontend process spends seconds importing vLLM's request models, tokenizer and parsers (8.5 s
    on this 2-core box, idle) before it serves. So one process is always kept started and imported
    but idle (``frontend-standby``, a root child), and a frontend process that must (re)start takes
    it: it is told its index on stdin and serves within a second. Only when no standby is ready (the
    deployment's first start, two crashes in a row) does a process start cold."""

    def __init__(self, t: Topology, topology_path: str | Path, overrides: list[str], listener: HttpListener,
                 supervisors: list[str], on_status: Callable[[str], None]) -> None:
        self.t = t
        self.topology_path = topology_path
        self.listener = listener
        self.supervisors = supervisors
        self.on_status = on_status
        self.env_overrides = json.dumps(worker_overrides(t, overrides))
        self.spare: ProcessChild | None = None
        self.taken = asyncio.Event()  # a standby was taken (or died): make another

    def process(self, name: str, index: int | None) -> ProcessChild:
        from supervisors.process import ProcessChild
        # the descriptor number is only known once bound: read at each start
        env = {OVERRIDES_ENV: self.env_overrides, HTTP_FD_ENV: str(self.listener.fd())}
        return ProcessChild(name, frontend_argv(self.topology_path, index, self.supervisors), env=env,
                            ready_timeout=READY_TIMEOUT, on_status=self.on_status if index is not None else None,
                            pass_fds=lambda: [self.listener.fd()],
                            go=b"" if index is None else None)  # a standby's stdin: its index, once taken

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
            cid = f"frontend-{i}"

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
    """The root child that keeps ``FrontendProcesses.spare`` filled: a new standby is started each
    time one is taken or dies."""

    def __init__(self, pool: FrontendProcesses) -> None:
        self.pool = pool
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        await self._fill()

    async def _fill(self) -> None:
        pool = self.pool
        pool.taken.clear()
        if pool.spare is None or pool.spare.returncode is not None:
            spare = pool.process("frontend-standby", None)
            await spare.spawn()
            pool.spare = spare

    async def wait(self) -> None:
        while not self._stopped.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.pool.taken.wait(), 1.0)
            if not self._stopped.is_set():
                await self._fill()  # taken, or died (checked each second)

    async def stop(self, timeout: float | None) -> None:
        self._stopped.set()
        spare, self.pool.spare = self.pool.spare, None
        if spare is not None:
            await spare.stop(None)  # idle: nothing to drain
