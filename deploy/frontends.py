"""The frontend as N OS processes (``frontend.processes`` > 1): the root binds the HTTP address once
(``HttpListener``) and supervises N ``actors.frontend.process`` children that inherit it.

Each process is a ``permanent`` child of the root, beside the workers: a SIGKILLed frontend process
is restarted alone (the root's strategy is one_for_one by default), while the root keeps
supervision, the control service and the embedded nats-server, and the other frontend processes
keep serving from the same socket. Why one inherited socket rather than SO_REUSEPORT:
``actors.frontend.shared_socket``.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from config.topology import Topology
from config.workers import HTTP_FD_ENV, OVERRIDES_ENV, worker_overrides
from supervisors.child import Child, ChildSpec

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


def frontend_argv(topology_path: str | Path, index: int, supervisors: list[str]) -> list[str]:
    return [sys.executable, "-m", "actors.frontend.process", "--topology", str(Path(topology_path).resolve()),
            "--index", str(index), "--supervisors", ",".join(supervisors)]


def frontend_specs(t: Topology, topology_path: str | Path, overrides: list[str], listener: HttpListener,
                   supervisors: list[str], on_status: Callable[[str], None]) -> list[tuple[ChildSpec, list[str]]]:
    """(child spec, argv) of each frontend process."""
    out = []
    for i in range(t.frontend.processes):
        argv = frontend_argv(topology_path, i, supervisors)
        cid = f"frontend-{i}"

        def start(cid: str = cid, argv: list[str] = argv) -> Child:
            from supervisors.process import ProcessChild
            # the descriptor number is only known once bound: read at each start
            env = {OVERRIDES_ENV: json.dumps(worker_overrides(t, overrides)), HTTP_FD_ENV: str(listener.fd())}
            return ProcessChild(cid, argv, env=env, ready_timeout=READY_TIMEOUT, on_status=on_status,
                                pass_fds=lambda: [listener.fd()])

        # drains its streams on a stop, as the in-process frontend does
        spec = ChildSpec(cid, start, "permanent", t.supervisor.drain_timeout + 5.0, parallel=True,
                         meta={"role": "frontend", "index": str(i)})
        out.append((spec, argv))
    return out

