"""systemd unit files for a topology: one ``Type=notify`` unit per host, plus a nats-server unit
when the topology embeds NATS.

Under systemd the nats-server is its own unit rather than a child of the supervisor, so restarting
a host's supervisor does not take the bus (and every other host's connections) down with it. The
host units therefore run the supervisor with ``--set bus.url=...`` so it does not embed a second one.
The embedded server listens on 127.0.0.1 only, so such units are for hosts on the same machine,
unless the topology's bus is a cluster (``bus.cluster``): then every host gets a nats unit of its own
(``vllm-actors-<ns>-<host>-nats.service``) whose config routes to the other hosts' servers, and its
supervisor unit requires that one; copy each host's two units (and its nats config) to that host.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from bus.embedded import nats_server_binary
from config.paths import nats_store
from config.topology import Topology
from config.workers import server_name
from deploy import nats_conf

log = logging.getLogger(__name__)

UNIT_PREFIX = "vllm-actors"


def host_unit_name(topology: Topology, host: str) -> str:
    return f"{UNIT_PREFIX}-{topology.namespace}-{host}.service"


def _member(topology: Topology, host: str | None) -> str | None:
    """``host`` when its nats unit is a cluster member's, None for the machine's one bus."""
    return host if topology.bus.cluster is not None else None


def _nats_stem(topology: Topology, host: str | None) -> str:
    """``vllm-actors-<ns>[-<host>]-nats``: one bus per machine, or one cluster member per host."""
    member = _member(topology, host)
    return f"{UNIT_PREFIX}-{topology.namespace}{f'-{member}' if member else ''}-nats"


def nats_unit_name(topology: Topology, host: str | None = None) -> str:
    return f"{_nats_stem(topology, host)}.service"


def nats_server_path() -> str:
    """Absolute path of nats-server, found as the embedded bus finds it (NATS_SERVER_BIN, the
    environment's scripts, PATH)."""
    return os.path.abspath(nats_server_binary())


def quote_arg(arg: str) -> str:
    """Quote one ExecStart argument: systemd expands ``%`` specifiers and ``$`` variables, and
    splits on whitespace, so escape all three."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in ' \t"\'\\;'):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _exec(argv: list[str]) -> str:
    return " ".join(quote_arg(a) for a in argv)


def _render(sections: dict[str, list[tuple[str, object]]], header: str) -> str:
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section, items in sections.items():
        out.append("")
        out.append(f"[{section}]")
        out += [f"{k}={v}" for k, v in items if v is not None]
    return "\n".join(out) + "\n"


def nats_store_dir(topology: Topology, host: str | None = None) -> tuple[str, str | None]:
    """(store dir, StateDirectory= value or None). Without an explicit store dir the unit lets
    systemd create /var/lib/vllm-actors/<ns>/nats (a cluster member: nats-<host>) owned by the
    unit's user."""
    if topology.bus.store_dir:
        return os.path.abspath(nats_store(topology, host or "")), None
    member = _member(topology, host)
    state = f"{UNIT_PREFIX}/{topology.namespace}/nats{f'-{member}' if member else ''}"
    return f"/var/lib/{state}", state


def nats_conf_name(topology: Topology, host: str | None = None) -> str:
    return f"{_nats_stem(topology, host)}.conf"


def render_nats_unit(topology: Topology, topology_path: Path, conf: Path, host: str | None = None) -> str:
    s = topology.systemd
    store, state_dir = nats_store_dir(topology, host)
    member = _member(topology, host)
    name = server_name(topology, member) if member else f"{topology.namespace}-nats"
    argv = [nats_server_path(), "-c", str(conf), "-js", "-sd", store, "-a", "127.0.0.1",
            "-p", str(topology.bus.port), "-n", name]
    what = f"host {member}'s member of the NATS cluster" if member else "embedded NATS bus"
    return _render({
        "Unit": [
            ("Description", f"vllm-actors {topology.namespace}: {what} (JetStream)"),
            # a cluster member binds its routes to the host's address: wait until the network has it
            ("After", "network-online.target" if member else "network.target"),
            ("Wants", "network-online.target" if member else None),
            ("StartLimitIntervalSec", s.start_limit_interval_sec),
            ("StartLimitBurst", s.start_limit_burst),
        ],
        "Service": [
            ("Type", "simple"),
            ("ExecStart", _exec(argv)),
            # an included users file reads passwords from the environment ($NAME)
            ("EnvironmentFile", f"-{s.environment_file}" if s.environment_file else None),
            ("User", s.user),
            ("StateDirectory", state_dir),
            ("Restart", "on-failure"),
            ("RestartSec", s.restart_sec),
            ("TimeoutStopSec", s.timeout_stop_sec),
            ("LimitNOFILE", 65536),
        ],
        "Install": [("WantedBy", "multi-user.target")],
    }, f"Generated by `python -m actors.supervisor --emit-systemd` from {topology_path}; do not edit.")


def render_host_unit(topology: Topology, topology_path: Path, host: str, python: str) -> str:
    s = topology.systemd
    embeds = topology.bus.url is None
    argv = [python, "-m", "actors.supervisor", str(topology_path), "--host", host]
    after = ["network-online.target"]
    requires = None
    if embeds:
        argv += ["--set", f"bus.url=nats://127.0.0.1:{topology.bus.port}"]
        after.append(nats_unit_name(topology, host))
        requires = nats_unit_name(topology, host)
    # relative paths in the topology (model dirs, LoRA roots) mean what they meant where the operator
    # ran --emit-systemd
    workdir = s.working_directory or os.getcwd()
    return _render({
        "Unit": [
            ("Description", f"vllm-actors {topology.namespace}: supervisor of host {host}"),
            ("After", " ".join(after)),
            ("Wants", "network-online.target"),
            ("Requires", requires),
            ("StartLimitIntervalSec", s.start_limit_interval_sec),
            ("StartLimitBurst", s.start_limit_burst),
        ],
        "Service": [
            # READY=1 once every child is up; STATUS= while engines load; WATCHDOG=1 pings.
            ("Type", "notify"),
            # worker processes may notify too (their own STATUS lines during model load)
            ("NotifyAccess", "all"),
            ("ExecStart", _exec(argv)),
            ("WorkingDirectory", workdir),
            ("EnvironmentFile", f"-{s.environment_file}" if s.environment_file else None),
            ("User", s.user),
            ("Environment", "PYTHONUNBUFFERED=1"),
            ("WatchdogSec", s.watchdog_sec or None),
            ("Restart", "on-failure"),
            ("RestartSec", s.restart_sec),
            # SIGTERM to the supervisor only: it stops its children in reverse order itself; the
            # rest of the cgroup is SIGKILLed only if it is still there after TimeoutStopSec.
            ("KillMode", "mixed"),
            ("TimeoutStopSec", s.timeout_stop_sec),
            # model loading can take minutes (STATUS= says why); unbounded unless the topology says
            ("TimeoutStartSec", s.timeout_start_sec if s.timeout_start_sec else "infinity"),
        ],
        "Install": [("WantedBy", "multi-user.target")],
    }, f"Generated by `python -m actors.supervisor --emit-systemd` from {topology_path}; do not edit.\n"
       f"Host {host} of namespace {topology.namespace}.")


def emit_units(topology: Topology, topology_path: str | Path, out_dir: str | Path,
               python: str | None = None) -> list[Path]:
    """Write the unit files for every host of ``topology`` into ``out_dir``; return their paths."""
    topology_path = Path(topology_path).resolve()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    python = python or topology.systemd.python or sys.executable
    # keep the venv's bin path: resolving the symlink would escape the venv and lose its packages
    python = os.path.abspath(python)
    written: list[Path] = []
    if topology.bus.url is None:
        # one bus for the machine, or one cluster member per host (its routes to the others)
        members: list[str | None] = list(topology.hosts()) if topology.bus.cluster is not None else [None]
        for member in members:
            conf = out.resolve() / nats_conf_name(topology, member)
            # what the embedded server would run with: auth, TLS, an included users file, the
            # cluster's routes (mode 0600: it may hold the token or a password)
            nats_conf.write(topology.bus, conf, host=member, namespace=topology.namespace)
            p = out / nats_unit_name(topology, member)
            p.write_text(render_nats_unit(topology, topology_path, conf, member))
            written.append(p)
            log.info("wrote %s", conf)
    for host in topology.hosts():
        p = out / host_unit_name(topology, host)
        p.write_text(render_host_unit(topology, topology_path, host, python))
        written.append(p)
    for p in written:
        log.info("wrote %s", p)
    return written
