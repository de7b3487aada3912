"""The command line (``python -m actors.supervisor TOPOLOGY``, also ``python -m deploy.cli``): start a
deployment's share on this host.

    --set key.path=value   override a topology value (repeatable; value is a TOML literal or a string)
    --host NAME            start only that host's share (default: every host of the topology)
    --check                validate and print the resolved tree, start nothing (exit 2 on errors)

At its start (and with --check) it builds the engine configuration of each pool of its hosts
(--host, or every host) as their workers would, on this machine's platform, without the engine
(vLLM: no weights read): an engine arg the engine rejects is exit 2. The mocker's are checked before
anything starts; vLLM's (10-30 s of import) while the tree starts, which a rejection stops.
    --emit-systemd DIR     write systemd units for every host into DIR
    --emit-prometheus FILE write a Prometheus scrape configuration for the topology into FILE
                           (``-``: standard output; --scrape-interval sets its interval)

Exit codes: 0 after a requested shutdown (SIGTERM/SIGINT), 1 when the root supervisor gave up
(systemd's Restart=on-failure then restarts the host), 2 for a bad topology or command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bus import event_loop, tracing
from bus.auth_callout import WorkerAuthority
from bus.process_exit import exit_process
from config.credentials import scoped_workers_problem
from config.loader import TopologyError, load_topology
from config.topology import Topology
from config.workers import kv_replicas
from deploy import prometheus
from deploy.engine_check import check_engines, check_vllm_engines
from deploy.pools import PoolSpawner
from deploy.root_metrics import RootMetricsServer
from deploy.systemd import emit_units
from deploy.tree import (
    INPROC,
    BusLink,
    HostPlan,
    build_host_tree,
    describe_plan,
    plan_host,
)
from supervisors.sdnotify import Notifier, serve_root
from supervisors.service import SupervisorService
from supervisors.supervisor import Supervisor

log = logging.getLogger("actors.supervisor")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# A worker whose engine rejects its configuration (its process exits with EXIT_CONFIG) is started
# again this many times while the error stays the same (a model directory being written, say),
# then stopped and kept, with the reason in the children view and /health; its siblings go on.
MISCONFIGURED_RETRIES = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m actors.supervisor",
                                description="Start (or check, or emit systemd units for) a topology.")
    p.add_argument("topology", help="topology TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a topology value (repeatable)")
    p.add_argument("--host", help="start only this host's share")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="validate and print the tree; start nothing")
    mode.add_argument("--emit-systemd", metavar="DIR", help="write systemd unit files into DIR")
    mode.add_argument("--emit-prometheus", metavar="FILE",
                      help="write a Prometheus scrape configuration into FILE ('-': stdout)")
    p.add_argument("--scrape-interval", default="15s", help="scrape interval of --emit-prometheus")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def shares(t: Topology, host: str | None) -> tuple[str, list[str]]:
    """(name of this process's root, hosts whose children it runs)."""
    hosts = t.hosts()
    if host is not None:
        if host not in hosts:
            raise TopologyError("--host", None, f"{host!r} is not a host of this topology "
                                                f"(hosts: {', '.join(hosts)})")
        return host, [host]
    # one process for the whole topology: named after its only host, or "all"
    return (hosts[0] if len(hosts) == 1 else "all"), hosts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        t = load_topology(args.topology, args.overrides)
        name, hosts = shares(t, args.host)
        if args.emit_prometheus:
            return _emit_prometheus(t, args)
        if not args.emit_systemd:  # units are written for other machines, whose engines are theirs
            # an engine arg the engine rejects would fail every worker start: refuse it now (a start
            # checks vLLM's pools while its tree starts: boot)
            check_engines(t, hosts, args.topology, args.overrides, vllm=bool(args.check))
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    problem = scoped_workers_problem(t.bus, systemd=bool(args.emit_systemd))
    if problem is not None:
        print(f"error: {args.topology}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.emit_systemd:
        try:
            paths = emit_units(t, args.topology, args.emit_systemd)
        except (OSError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        for path in paths:
            print(path)
        return EXIT_OK
    if args.check:
        print(f"{args.topology}: namespace {t.namespace}, bus {_bus_words(t)}")
        for h in ([args.host] if args.host else t.hosts()):
            print("\n".join(describe_plan(plan_host(t, h, args.topology, args.overrides,
                                                    control=_control_factory(None, None)), t)))
        return EXIT_OK
    if t.bus.cluster is not None and t.bus.url is None and len(hosts) > 1:
        # each host's root runs that host's member of the cluster: one process cannot be several
        print(f"error: bus.cluster gives each host its own nats-server: start one supervisor per host "
              f"with --host NAME (hosts: {', '.join(hosts)})", file=sys.stderr)
        return EXIT_USAGE
    return event_loop.run(boot(t, args.topology, args.overrides, name, hosts))


def _emit_prometheus(t: Topology, args: argparse.Namespace) -> int:
    text = prometheus.render(t, scrape_interval=args.scrape_interval, source=args.topology,
                             overrides=args.overrides)
    if args.emit_prometheus == "-":
        sys.stdout.write(text)
        return EXIT_OK
    try:
        Path(args.emit_prometheus).write_text(text)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(args.emit_prometheus)
    return EXIT_OK


def _bus_words(t: Topology) -> str:
    if t.bus.url:
        return t.bus.url
    if t.bus.cluster is not None:
        return (f"a cluster of {len(t.bus.cluster.servers)} embedded nats-servers (each host's on "
                f"127.0.0.1:{t.bus.port}, routes on port {t.bus.cluster.port}; registry replicas {kv_replicas(t)})")
    return f"embedded nats-server on 127.0.0.1:{t.bus.port}"


def _control_factory(root_ref: list[Any] | None,
                     spawner: PoolSpawner | None) -> Callable[[BusLink], Any]:
    """The root's micro service: built at (re)start time, once the root supervisor exists."""

    def make(link: BusLink) -> Any:
        return ControlChild(link, root_ref[0], spawner)

    return make


class ControlChild:
    """Child adapter for the root's micro service (``supervisors.service.SupervisorService``):
    it lives in ``inproc`` because it needs this process's connection."""

    name = "control"

    def __init__(self, link: BusLink, root: Any, spawner: PoolSpawner | None) -> None:
        # spawn over NATS (operators, a planner) adds a replica of a pool this root runs, built
        # from the topology: the message names the pool, never a command
        self.svc = SupervisorService(link.child_ctx(), root, spawner=spawner.spec if spawner else None,
                                     hosts_service=(INPROC,))
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        await self.svc.start()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self, timeout: float | None) -> None:
        self._stopped.set()
        await self.svc.stop()


async def boot(t: Topology, topology_path: str | Path, overrides: list[str], name: str,
               hosts: list[str]) -> int:
    root_ref: list[Any] = []
    # bus.scoped_workers: one issuer of worker users for the tree's workers and the control's spawns
    authority = WorkerAuthority() if t.bus.scoped_workers else None
    spawner = PoolSpawner(t, topology_path, overrides, hosts, authority)
    plan: HostPlan = plan_host(t, name, topology_path, overrides, hosts=hosts,
                               control=_control_factory(root_ref, spawner), authority=authority)
    s = t.supervisor
    root = Supervisor(name, build_host_tree(plan), strategy=s.strategy,
                      intensity=s.intensity, period=s.period, start_concurrency=s.start_concurrency,
                      misconfigured_retries=MISCONFIGURED_RETRIES,
                      backoff={"initial": s.backoff.initial, "max": s.backoff.max,
                               "multiplier": s.backoff.multiplier, "jitter": s.backoff.jitter})
    root_ref.append(root)
    plan.status.target = lambda text: root.on_status(text) if root.on_status else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s again: already shutting down", sig.name)
            return
        log.info("%s: shutting down (bound %gs)", sig.name, s.shutdown_timeout)
        stop.set()  # serve_root watches it while starting too (engines may load for minutes)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    log.info("namespace %s: starting %s (hosts %s; bus %s)", t.namespace, name, ", ".join(hosts), _bus_words(t))
    fe = t.frontend
    if fe.enabled and fe.host in hosts and fe.processes <= 1:  # the frontend runs in this process
        tracing.configure(t.tracing, service="vllm-actors-frontend", namespace=t.namespace,
                          instance=f"frontend-{fe.host}")
    rejected: list[TopologyError] = []
    metrics_server = None
    if t.metrics.root_port is not None:
        metrics_server = RootMetricsServer(t.metrics.root_host, t.metrics.root_port,
                                           [plan.planner_metrics.registry] if plan.planner_metrics else [])
        try:
            await metrics_server.start()
        except OSError as e:  # a taken port: the operator asked for this listener, so say it and stop
            log.error("root metrics on %s:%d: %s", t.metrics.root_host, t.metrics.root_port, e)
            return EXIT_FAILED
    checking = asyncio.create_task(_check_vllm_beside_the_start(t, hosts, topology_path, overrides, stop, rejected))
    try:
        code = await serve_root(root, stop, Notifier(), shutdown_timeout=s.shutdown_timeout)
    finally:
        if metrics_server is not None:
            await metrics_server.stop()
        checking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checking
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        tracing.shutdown()  # what is buffered leaves before the process does
    if rejected:
        code = EXIT_USAGE
    log.info("supervisor %s exits with %d", name, code)
    if rejected:
        print(f"error: {rejected[0]}", file=sys.stderr)  # the last line, after the shutdown's
    return code


async def _check_vllm_beside_the_start(t: Topology, hosts: list[str], topology_path: str | Path,
                                       overrides: list[str], stop: asyncio.Event,
                                       rejected: list[TopologyError]) -> None:
    """vLLM's check of this host's engine configurations, while the tree starts: a rejection stops
    the deployment (its workers would fail the same way on every start) and the root exits 2."""
    try:
        await check_vllm_engines(t, hosts, str(topology_path), overrides)
    except TopologyError as e:
        rejected.append(e)
        log.error("engine configuration rejected: %s; stopping", e)
        stop.set()


if __name__ == "__main__":
    exit_process(main())
