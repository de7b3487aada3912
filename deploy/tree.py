"""The supervision tree of one host, derived from a Topology.

    root <host> (topology.supervisor: strategy, intensity, period, backoff)
    ├── nats            embedded nats-server (only when the topology names no bus.url)
    ├── inproc          rest_for_one: everything that shares this process's NATS connection
    │   ├── bus         the one NATS connection of this OS process
    │   ├── control     the root supervisor's micro service (ns.supervisor.<host>.*)
    │   ├── frontend    the OpenAI HTTP gateway, on its host (with the kv router it also serves
    │   │               ns.router.*: the process's one KV router, no separate router actor)
    │   ├── planner     (when [planner] enabled names this host: scales pools through the roots,
    │   │               and wakes cold ones)
    │   ├── waker       without a planner: wakes this host's cold pools on demand, removes idle
    │   │               replicas (sleep.idle_stop)
    │   └── echo        the example actor, when `echo = true` and this host is in echo_hosts
    ├── frontend-<i>    with frontend.processes = N > 1, the frontend instead runs as N OS processes
    │                   served the connections this process accepts (deploy.frontends)
    └── worker-<pool>-<i>   one OS process per worker replica (its own connection and supervisor)

Why ``inproc`` is rest_for_one with the connection first: the in-process actors hold the
connection, so if it is ever replaced they must be restarted with it. Workers sit beside it at the
root (one_for_one by default) so a hiccup in this process's connection never reloads an engine.
NATS first and stopped last: every other child needs it.

``plan_host`` builds the tree as data (nothing is started or imported), so ``--check`` can print
it; ``build_host_tree`` turns a plan into the root's ChildSpecs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.auth_callout import WorkerAuthority
from config.paths import nats_store, profile_dir, profile_path
from config.topology import BackoffConfig, PoolConfig, SupervisorConfig, Topology
from config.workers import bus_url, embeds_nats, kv_replicas, server_name
from deploy import nats_conf
from deploy.frontends import FrontendProcesses, HttpListener
from deploy.pools import worker_spec
from supervisors.child import Child, ChildSpec

if TYPE_CHECKING:
    from actors.planner.metrics import PlannerMetrics

log = logging.getLogger(__name__)

# Bound on the first connect: nats-py retries forever, which would hang a start whose server is not
# coming (or not yet restarted); failing the start lets the supervisor count it and back off.
BUS_CONNECT_TIMEOUT = 10.0

# the root's child that runs the in-process actors (frontend, planner, waker) and the root's own
# control service with its bus connection
INPROC = "inproc"


class BusLink:
    """Child owning the process's one NATS connection (a ``bus.context.BusContext``).

    nats-py reconnects forever on its own, so this child only ends when the connection is closed
    for good (then the in-process actors are restarted on a fresh one by ``inproc``)."""

    def __init__(self, t: Topology, host: str, name: str = "bus",
                 status: Callable[[str], None] | None = None,
                 authority: WorkerAuthority | None = None) -> None:
        self.name = name
        self.topology = t
        self.host = host
        self.status = status  # STATUS= lines while the start waits (for JetStream)
        # bus.scoped_workers: this connection answers the server's auth callout for the workers
        # this root starts (before any of them connects: they start after the inproc children)
        self.authority = authority
        self.ctx: Any = None  # bus.context.BusContext once started
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        from bus.context import open_context
        from bus.registry import wait_for_jetstream
        self._stopped.clear()
        t = self.topology
        try:
            ctx = await asyncio.wait_for(open_context(
                t.bus, t.namespace, self.host, f"vllm-actors:{t.namespace}:{self.host}:{os.getpid()}",
                kv_replicas(t)), BUS_CONNECT_TIMEOUT)
        except TimeoutError:
            raise ConnectionError(f"no NATS server at {bus_url(t)} within "
                                  f"{BUS_CONNECT_TIMEOUT:g}s") from None
        log.info("bus: connected to %s as host %s", ctx.nc.connected_url.netloc
                 if ctx.nc.connected_url else bus_url(t), self.host)

        def waiting(text: str) -> None:
            log.warning("bus: %s", text)
            if self.status is not None:
                self.status(f"bus: {text}")

        try:
            if self.authority is not None:
                await self.authority.serve(ctx.nc)
            # every actor of this process writes the registry: a cluster still electing its JetStream
            # leader (its other hosts not up yet) is waited for here, not failed actor by actor
            await wait_for_jetstream(ctx.nc, waiting)
        except BaseException:
            await ctx.nc.close()
            raise
        self.ctx = ctx

    async def wait(self) -> None:
        while not self._stopped.is_set():
            if self.ctx is not None and self.ctx.nc.is_closed:
                raise ConnectionError("NATS connection closed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), 1.0)

    async def stop(self, timeout: float | None) -> None:
        self._stopped.set()
        if self.ctx is None:
            return
        ctx, self.ctx = self.ctx, None
        if timeout is None:
            await ctx.nc.close()
        else:
            try:
                await asyncio.wait_for(ctx.close(), timeout)  # drain: flush what actors sent last
            except TimeoutError:
                await ctx.nc.close()

    def child_ctx(self) -> Any:
        if self.ctx is None:
            raise ConnectionError("bus not connected")
        return self.ctx.child()


class StatusRelay:
    """Forwards nested supervisors' status lines to whatever ``target`` is at call time (the CLI
    points it at the root's on_status, which serve_root turns into sd_notify STATUS=)."""

    def __init__(self) -> None:
        self.target: Callable[[str], None] | None = None

    def __call__(self, text: str) -> None:
        if self.target is not None:
            self.target(text)


@dataclass
class Node:
    """One entry of a host's plan: a leaf child, or a nested supervisor with ``children``."""

    spec: ChildSpec
    kind: str  # nats | bus | control | actor | process | supervisor
    detail: str = ""
    supervisor: SupervisorConfig | None = None
    children: list[Node] = field(default_factory=list)


@dataclass
class HostPlan:
    host: str
    name: str
    supervisor: SupervisorConfig
    children: list[Node]
    link: BusLink
    status: StatusRelay
    # the planner's series when it runs in this root: the root's metrics listener serves them too
    planner_metrics: PlannerMetrics | None = None


def plan_host(t: Topology, host: str, topology_path: str | Path, overrides: list[str] | None = None,
              *, hosts: list[str] | None = None,
              control: Callable[[BusLink], Child] | None = None,
              authority: WorkerAuthority | None = None) -> HostPlan:
    """The tree for ``host`` (or, with ``hosts``, several hosts' shares in one process named
    ``host``). ``control`` makes the root's micro service; it is called at (re)start time.
    ``authority``: the root's issuer of per-process worker users (``bus.scoped_workers``; made here
    when not given), shared with the control service's spawns."""
    shares = hosts or [host]
    overrides = list(overrides or [])
    sup = t.supervisor
    relay = StatusRelay()
    if authority is None and t.bus.scoped_workers:
        authority = WorkerAuthority()
    link = BusLink(t, host, status=relay, authority=authority)
    nodes: list[Node] = []
    if embeds_nats(t):
        nodes.append(_nats_node(t, host, authority))

    inproc: list[Node] = [Node(ChildSpec("bus", lambda: link, "permanent", sup.drain_timeout),
                               "bus", f"NATS connection to {bus_url(t)}")]
    if control is not None:
        inproc.append(Node(ChildSpec("control", lambda: control(link), "permanent", sup.drain_timeout),
                           "control", f"supervisor micro service on {t.namespace}.supervisor.{host}.*"))
    # the planner's series are served by the frontend's /metrics when both run in this process; made
    # once per plan, so that a restarted planner (or frontend) keeps the same counters
    planner_metrics = None
    if t.planner.enabled and t.planner.host in shares:
        from actors.planner.metrics import PlannerMetrics
        planner_metrics = PlannerMetrics()
    for h in shares:
        inproc += (_frontend_nodes(t, h, link, relay, shares, planner_metrics)
                   + _planner_nodes(t, h, link, shares, planner_metrics))
        if t.echo and h in t.echo_hosts:
            inproc.append(_echo_node(t, h, link, multi=len(shares) > 1))
    inproc += _waker_nodes(t, link, shares)
    inproc_sup = SupervisorConfig(strategy="rest_for_one", intensity=sup.intensity, period=sup.period,
                                  backoff=sup.backoff, shutdown_timeout=sup.shutdown_timeout,
                                  drain_timeout=sup.drain_timeout)
    nodes.append(Node(ChildSpec(INPROC, lambda: _supervisor(f"{host}/inproc", inproc, inproc_sup, relay),
                                "permanent", sup.shutdown_timeout),
                      "supervisor", "in-process actors", inproc_sup, inproc))

    fe = t.frontend
    if fe.enabled and fe.processes > 1 and fe.host in shares:
        listener = HttpListener(fe.http)
        roots = sorted({link.host if p.host in shares else p.host for p in t.pools.values()})
        for spec, cmd in FrontendProcesses(t, topology_path, overrides, listener, roots, relay).specs():
            what = ("warm standby frontend process (taken by a frontend process that restarts)"
                    if spec.id == "frontend-standby" else
                    f"FrontendActor process serving {fe.http} (router {fe.router})")
            nodes.append(Node(spec, "process", f"{what}: {cmd}"))
    for name, pool in t.pools.items():
        if pool.host in shares:
            nodes += _worker_nodes(t, name, pool, topology_path, overrides, authority)
    return HostPlan(host, host, sup, nodes, link, relay, planner_metrics)


def build_host_tree(plan: HostPlan) -> list[ChildSpec]:
    """The root supervisor's children for a plan."""
    return [n.spec for n in plan.children]


def _supervisor(name: str, nodes: list[Node], cfg: SupervisorConfig,
                status: Callable[[str], None] | None = None) -> Child:
    from supervisors.supervisor import Supervisor
    return Supervisor(name, [n.spec for n in nodes], strategy=cfg.strategy, intensity=cfg.intensity,
                      period=cfg.period, backoff=_backoff(cfg.backoff), on_status=status,
                      start_concurrency=cfg.start_concurrency)


def _backoff(b: BackoffConfig) -> dict[str, float]:
    return {"initial": b.initial, "max": b.max, "multiplier": b.multiplier, "jitter": b.jitter}


def _nats_node(t: Topology, host: str, authority: WorkerAuthority | None = None) -> Node:
    """This host's embedded nats-server: the deployment's bus, or with ``bus.cluster`` this host's
    member of the cluster (a name that stays the same across restarts, its own store dir: hosts
    of one cluster may share a file system, as the namespace tests do)."""
    store = str(nats_store(t, host))
    name = server_name(t, host) if t.bus.cluster is not None else None

    def start() -> Child:
        from bus.embedded import EmbeddedNats
        return EmbeddedNats(port=t.bus.port, store_dir=store, name="nats", server_name=name,
                            write_config=lambda path: nats_conf.write(t.bus, path, host=host, namespace=t.namespace),
                            env={nats_conf.CALLOUT_ISSUER_ENV: authority.issuer} if authority is not None else {})

    return Node(ChildSpec("nats", start, "permanent", min(10.0, t.supervisor.shutdown_timeout)),
                "nats", f"embedded nats-server 127.0.0.1:{t.bus.port}{f' named {name}' if name else ''} "
                f"({nats_conf.describe(t.bus)}; JetStream store {store})")


def _echo_node(t: Topology, host: str, link: BusLink, multi: bool) -> Node:
    def start() -> Child:
        from actors.echo.actor import EchoActor
        return EchoActor(link.child_ctx(), instance=host)

    return Node(ChildSpec(f"echo-{host}" if multi else "echo", start, "permanent",
                          t.supervisor.drain_timeout), "actor", f"EchoActor instance {host}")


def _worker_nodes(t: Topology, name: str, pool: PoolConfig, topology_path: str | Path,
                  overrides: list[str], authority: WorkerAuthority | None = None) -> list[Node]:
    nodes = []
    for i in range(pool.replicas):
        spec, argv = worker_spec(t, name, i, topology_path, overrides, authority)
        nodes.append(Node(spec, "process", f"{pool.role} {pool.engine} worker: {' '.join(argv[1:])}"))
    return nodes


# --- in-process serving actors of a host ----------------------------------------------------------


def _frontend_nodes(t: Topology, host: str, link: BusLink, status: Callable[[str], None],
                    shares: list[str], planner_metrics: PlannerMetrics | None = None) -> list[Node]:
    """The OpenAI HTTP frontend, on the host the topology names. It knows the pools it waits for
    (readiness) and which roots to ask what a missing worker is doing: this process's root (named
    ``link.host``) for the hosts it runs, each other host's own root otherwise."""
    if not (t.frontend.enabled and t.frontend.host == host) or t.frontend.processes > 1:
        return []  # several processes: root children of their own (plan_host)
    fe, model = t.frontend, t.model
    roots = sorted({link.host if p.host in shares else p.host for p in t.pools.values()})

    def start() -> Child:
        from actors.frontend.actor import FrontendActor
        return FrontendActor(link.child_ctx(), config=fe, model_config=model, instance=f"frontend-{host}",
                             pools=t.pools, supervisor_hosts=roots, on_status=status, planner=t.planner,
                             extra_metrics=[planner_metrics.registry] if planner_metrics is not None else [])

    return [Node(ChildSpec("frontend", start, "permanent", t.supervisor.drain_timeout), "actor",
                 f"FrontendActor http://{fe.http}/v1 (router {fe.router}"
                 + (f"; KV router endpoints on {t.namespace}.router.*)" if fe.router == "kv" else ")"))]


def _planner_nodes(t: Topology, host: str, link: BusLink, shares: list[str],
                   metrics: PlannerMetrics | None) -> list[Node]:
    """The SLA planner, on the host ``planner.host`` names. It scales each pool through the root
    that runs it: this process's root (named ``link.host``) for the hosts it runs, each other host's
    own root otherwise."""
    pl = t.planner
    if not (pl.enabled and pl.host == host):
        return []
    roots = {name: (link.host if p.host in shares else p.host) for name, p in t.pools.items()}
    profiles = {name: profile_path(t, name) for name in t.pools}

    def start() -> Child:
        from actors.planner.actor import PlannerActor
        return PlannerActor(link.child_ctx(), config=pl, pools=t.pools, roots=roots, profiles=profiles,
                            model=t.model.name if t.model else None, metrics=metrics)

    mode = f"{pl.mode} mode{' (no-op)' if pl.no_op else ''}"
    return [Node(ChildSpec("planner", start, "permanent", t.supervisor.drain_timeout), "actor",
                 f"PlannerActor {mode} every {pl.effective_interval():g}s, TTFT {pl.ttft_target_ms:g} ms, "
                 f"ITL {pl.itl_target_ms:g} ms, budget {pl.budget} engines, profiles in {profile_dir(t)} "
                 f"(on {t.namespace}.planner.*)")]


def _waker_nodes(t: Topology, link: BusLink, shares: list[str]) -> list[Node]:
    """The waker of this process's pools (wake on demand, idle stop), unless a planner runs: it
    keeps every pool itself, so a wake and its own scaling never race."""
    if t.planner.enabled:
        return []
    pools = {name: p for name, p in t.pools.items() if p.host in shares}
    if not pools:
        return []

    def start() -> Child:
        from actors.planner.wake import KeptPool
        from actors.planner.waker import WakerActor
        return WakerActor(link.child_ctx(), pools={n: KeptPool.of(n, p, link.host) for n, p in pools.items()},
                          model=t.model.name if t.model else None)

    stops = [f"{n} after {p.sleep.idle_stop:g}s idle" for n, p in pools.items() if p.sleep.idle_stop]
    return [Node(ChildSpec("waker", start, "permanent", t.supervisor.drain_timeout), "actor",
                 f"WakerActor of pools {', '.join(pools)}: wakes a cold pool on demand "
                 f"({t.namespace}.wake.demand); idle stop: {'; '.join(stops) or 'off'}")]


# --- printing ------------------------------------------------------------------------------------


def describe_plan(plan: HostPlan, t: Topology) -> list[str]:
    s = plan.supervisor
    lines = [f"host {plan.host}: supervisor {plan.name} ({_sup_flags(s)})"]
    workers = sum(n.spec.parallel for n in plan.children)
    if workers:
        first = ", ".join(n.spec.id for n in plan.children if not n.spec.parallel)
        lines.append(f"  {workers} worker(s) start in parallel, at most {s.start_concurrency} at once"
                     + (f", once {first} are up" if first else ""))
    lines += _describe_nodes(plan.children, "  ")
    return lines


def _sup_flags(s: SupervisorConfig) -> str:
    b = s.backoff
    return (f"{s.strategy}, intensity {s.intensity}/{s.period:g}s, backoff {b.initial:g}s..{b.max:g}s "
            f"x{b.multiplier:g} ±{b.jitter:.0%}, shutdown {s.shutdown_timeout:g}s")


def _describe_nodes(nodes: list[Node], indent: str) -> list[str]:
    out = []
    for n in nodes:
        sh = n.spec.shutdown if n.spec.shutdown == "brutal_kill" else f"{float(n.spec.shutdown):g}s"
        if n.kind == "supervisor" and n.supervisor is not None:
            out.append(f"{indent}- {n.spec.id} [{n.spec.restart}] supervisor ({_sup_flags(n.supervisor)}): "
                       f"{n.detail}")
            out += _describe_nodes(n.children, indent + "    ")
        else:
            out.append(f"{indent}- {n.spec.id} [{n.spec.restart}, shutdown {sh}] {n.kind}: {n.detail}")
    return out
