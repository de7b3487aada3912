"""One worker OS process: ``python -m actors.worker.process --topology PATH --pool NAME --replica I``.

Inside: one NATS connection, a worker Supervisor (``rest_for_one`` by default) with
  engine actor → [ENGINE_DEPENDANTS: KV publisher, LoRA manager, ...] → health monitor,
served as a micro service on ``ns.supervisor.<host>.<worker-node>.*`` (so the health monitor's
``escalate`` reaches it), an optional status HTTP server, and sd_notify READY=1 to the parent once
every child (the engine included) is up. Exits 1 when the worker supervisor gives up, so the host's
root supervisor restarts the whole process; EXIT_CONFIG when its engine rejects its configuration
(its last STATUS says how), which the root retries only while the error could be a fluke.

Checkpoint mode (``pools.<p>.checkpoint.control_dir``): the engine is built and put to sleep before
any of the above exists, so a snapshot image holds no bus or HTTP socket (actors.worker.checkpoint).
A restored copy then connects and serves with that engine; the snapshotted original exits with
EXIT_SNAPSHOT_DONE.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from actors.engines.protocol import Engine
from actors.kv.translate import KvPublisherMetrics
from actors.worker import contract as C
from actors.worker import kv_publisher, lora_actor
from actors.worker.checkpoint import RESTORE_DONE, prepare
from actors.worker.contract import HealthReply, LivenessReply
from actors.worker.engine_actor import EngineActor
from actors.worker.engine_factory import advertised_host, factory_for, has_encode_pool, with_engine_spans
from actors.worker.health import HealthMonitor
from actors.worker.metrics import engine_metrics, process_metrics
from actors.worker.status_http import StatusServer, status_bind_host
from bus import event_loop, rpc, tracing
from bus.connection import until_closed
from bus.context import BusContext, open_context
from bus.process_exit import exit_process
from bus.tasks import cancel_and_wait
from config.loader import load_topology
from config.topology import PoolConfig, Topology
from config.workers import (
    MAX_REPLICA,
    given_instance,
    kv_replicas,
    overrides_from_env,
    worker_bus,
    worker_child_id,
)
from supervisors.child import ChildSpec
from supervisors.process import EXIT_CONFIG, EXIT_DONE
from supervisors.sdnotify import Notifier, serve_root
from supervisors.service import SupervisorService
from supervisors.supervisor import Supervisor

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# The snapshotter has imaged this process: its job is over and it must not be restarted (the root
# counts supervisors.process.EXIT_DONE as a normal exit of a checkpoint pool's worker).
EXIT_SNAPSHOT_DONE = EXIT_DONE


@dataclass
class WorkerEnv:
    """What a child factory of the worker gets to build its actor."""

    ctx: BusContext  # the process's connection (use ctx.child() per actor)
    topology: Topology
    pool_name: str
    pool: PoolConfig
    replica: int
    instance: str  # the engine actor's instance id (stable across engine restarts in this process)
    node: str  # the worker supervisor's node name
    # the KV publisher's counters, on a registry of this worker's own that /metrics exports: they
    # outlive a restarted publisher, which keeps counting on the same series
    kv_metrics: KvPublisherMetrics = field(default_factory=KvPublisherMetrics)
    engine_actor: EngineActor | None = None  # the current engine actor (for /metrics only)


ChildFactory = Callable[[WorkerEnv], ChildSpec | None]

# Actors that depend on the engine and therefore sit *after* it in rest_for_one order (an engine
# restart restarts them too), in this order. Each factory returns None when its actor is not for
# this pool (e.g. no KV publisher on decode workers, no LoRA manager without enable_lora).
ENGINE_DEPENDANTS: tuple[ChildFactory, ...] = (kv_publisher.worker_child, lora_actor.worker_child)


def cpu_slot(t: Topology, pool_name: str, replica: int) -> int | None:
    """This worker's index among the vLLM engine workers of its host (pools in file order), which
    pins its EngineCore to one core; None when it is the host's only vLLM engine.

    Pinning keeps several engines off each other's core (vLLM's own CPU binding puts every engine
    on core 0). A lone engine gains nothing from it and loses the other cores: pinned to core 0
    beside the frontend, nats-server and its worker's bus side, the tiny model served 0.83x of
    ``vllm serve``'s throughput at 16 streams; unpinned, as ``vllm serve`` runs it, 0.99x
    (docs/benchmarks.md, "Speed I")."""
    pool = t.pools[pool_name]
    if pool.engine != "vllm":
        return None
    engines = [(name, p) for name, p in t.pools.items() if p.host == pool.host and p.engine == "vllm"]
    if sum(p.replicas for _, p in engines) <= 1 and replica == 0:
        return None
    index = 0
    for name, p in engines:
        if name == pool_name:
            return index + replica
        index += p.replicas
    raise KeyError(pool_name)


def default_engine_factory(t: Topology, pool_name: str, replica: int) -> Callable[[], Engine]:
    # every replica is the same model (a mocker's seed is its "weights"): a migrated stream must
    # continue as if nothing happened
    pool = with_engine_spans(t, t.pools[pool_name])
    advertise = advertised_host(t, pool.host) if pool.engine == "vllm" else None
    return factory_for(pool, t.model, seed=0, replica=replica, cpu_slot=cpu_slot(t, pool_name, replica),
                       advertise=advertise, ec_consumer=pool.engine == "vllm" and has_encode_pool(t))


def build_children(env: WorkerEnv, engine_factory: Callable[[], Engine] | None = None,
                   restored: Engine | None = None) -> list[ChildSpec]:
    """``restored``: a started engine (checkpoint restore) that the first engine actor adopts; an
    engine restart after a death builds a fresh one with the factory."""
    t, pool = env.topology, env.pool
    factory = engine_factory or default_engine_factory(t, env.pool_name, env.replica)
    model = t.model.name if t.model else ""
    escalate = env.ctx.subjects.supervisor_node(env.ctx.host, env.node, "escalate")
    handoff = [restored] if restored is not None else []

    def engine() -> EngineActor:
        env.engine_actor = EngineActor(env.ctx.child(), pool_name=env.pool_name, pool=pool, model=t.model,
                                       engine_factory=factory, instance=env.instance,
                                       engine=handoff.pop() if handoff else None)
        return env.engine_actor

    def health() -> HealthMonitor:
        return HealthMonitor(env.ctx.child(), engine_instance=env.instance, pool_name=env.pool_name,
                             config=pool.health, escalate_subject=escalate, child_id="engine",
                             role=pool.role, model=model)

    shutdown = pool.supervisor.shutdown_timeout + pool.sleep.drain_timeout
    specs = [ChildSpec("engine", engine, "permanent", shutdown, meta={"instance": env.instance})]
    for make in ENGINE_DEPENDANTS:
        spec = make(env)
        if spec is not None:
            specs.append(spec)
    specs.append(ChildSpec("health", health, "permanent", 5.0))
    return specs


def ready_check(env: WorkerEnv) -> Callable[[], Any]:
    """/health: ready when the engine answers healthy and the health monitor is satisfied."""
    nc, sj = env.ctx.nc, env.ctx.subjects

    async def check() -> tuple[bool, dict[str, Any]]:
        h = await rpc.request(nc, sj.worker(env.instance, C.VERB_HEALTH), {}, timeout=5.0, reply_type=HealthReply)
        detail: dict[str, Any] = {"instance": env.instance, "engine": h.status}
        ok = h.status == "healthy"
        try:
            lv = await rpc.request(nc, sj.worker(env.instance, C.VERB_LIVENESS), {}, timeout=2.0,
                                   reply_type=LivenessReply)
            detail["liveness"] = lv.status
            ok = ok and lv.status == "ok"
        except Exception as e:  # noqa: BLE001 - no monitor answer yet: not ready
            detail["liveness"] = f"unavailable: {e}"
            ok = False
        return ok, detail

    return check


async def checkpoint_phase(pool: PoolConfig, factory: Callable[[], Engine], stop: asyncio.Event,
                           notifier: Notifier) -> Engine | int:
    """Checkpoint mode, before any bus connection exists: the awake engine of a restored copy, or
    the exit code of a process that is done (snapshot taken, stopped, or failed)."""
    engine = factory()

    def ready() -> None:
        # the parent supervisor may go on (a snapshot can take long); the socket is closed at once so
        # the image holds none of ours (a later notify opens a fresh one)
        notifier.ready(f"engine built and asleep; waiting for the snapshotter ({pool.checkpoint.control_dir})")
        notifier.close()

    try:
        outcome = await prepare(engine, pool.checkpoint, stop, on_ready=ready)
    except Exception as e:  # noqa: BLE001 - the process ends here; the root restarts it
        log.error("checkpoint: %s", e)
        await engine.shutdown()
        return EXIT_FAILED
    if outcome == RESTORE_DONE:
        return engine
    await engine.shutdown()
    if outcome is None:
        return EXIT_OK
    log.info("checkpoint: snapshot complete; this process is done and exits with %d (not restarted)",
             EXIT_SNAPSHOT_DONE)
    notifier.status("snapshot complete; not restarted")
    notifier.close()
    return EXIT_SNAPSHOT_DONE


def engine_phase(node: str, text: str) -> str:
    """The worker supervisor's start-up lines as the phases an operator waits through (the host's
    root shows them next to this worker while it starts): engine loading, engine up, serving."""
    line = text.removeprefix(f"{node}: ")
    if line == "starting engine":
        return "engine loading"
    if line.startswith("all ") and line.endswith(" children up"):
        return "serving"
    if line.startswith("starting ") and not line.endswith(" children"):
        return f"engine up, starting {line.removeprefix('starting ')}"
    return line


class PhaseNotifier(Notifier):
    """sd_notify for a worker process: STATUS= says which phase the worker is in."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def status(self, text: str) -> bool:
        return super().status(engine_phase(self.node, text))

    def ready(self, status: str | None = None) -> bool:
        return super().ready(engine_phase(self.node, status) if status else "serving")


async def run_worker(t: Topology, pool_name: str, replica: int, *, stop: asyncio.Event | None = None,
                     notifier: Notifier | None = None,
                     engine_factory: Callable[[], Engine] | None = None) -> int:
    pool = t.pools[pool_name]
    node = worker_child_id(pool_name, replica)
    instance = given_instance(pool_name, replica)  # the root's choice when it scoped our credentials
    stop = stop or asyncio.Event()
    tracing.configure(t.tracing, service="vllm-actors-worker", namespace=t.namespace, instance=instance)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    restored: Engine | None = None
    if pool.checkpoint.control_dir:
        notifier = notifier or PhaseNotifier(node)
        got = await checkpoint_phase(pool, engine_factory or default_engine_factory(t, pool_name, replica),
                                     stop, notifier)
        if isinstance(got, int):
            return got
        restored = got
    notifier = notifier or PhaseNotifier(node)
    notifier.status("connecting to NATS")
    try:
        ctx = await open_context(worker_bus(t), t.namespace, pool.host,
                                 f"vllm-actors:{t.namespace}:{node}:{os.getpid()}", kv_replicas(t),
                                 inbox_owner=instance)
    except BaseException:
        if restored is not None:
            await restored.shutdown()
        raise
    env = WorkerEnv(ctx, t, pool_name, pool, replica, instance, node)
    sc = pool.supervisor
    sup = Supervisor(node, build_children(env, engine_factory, restored), strategy=sc.strategy,
                     intensity=sc.intensity, period=sc.period, backoff=sc.backoff)
    service = SupervisorService(ctx, sup, node=node)
    await service.start()
    status: StatusServer | None = None
    if pool.status_port is not None:
        def render() -> tuple[bytes, str]:
            a = env.engine_actor
            body = a.metrics.render()[0] if a is not None else process_metrics() + engine_metrics()
            return body + generate_latest(env.kv_metrics.registry), CONTENT_TYPE_LATEST

        status = StatusServer(pool.status_port + replica if pool.status_port else 0, ready_check(env), render,
                              host=status_bind_host(pool, t.frontend),
                              endpoints=lambda: [ctx.subjects.generate(pool_name),
                                                 ctx.subjects.generate_instance(pool_name, instance)])
        await status.start()
    log.info("worker %s: instance %s, pool %s (%s, %s engine)", node, instance, pool_name, pool.role, pool.engine)
    # a connection closed for good leaves this worker off the bus: exit non-zero, so the root
    # restarts it, instead of living on unreachable
    lost = asyncio.create_task(until_closed(ctx.nc), name="bus-closed-watch")
    lost.add_done_callback(lambda _t: stop.set())
    try:
        code = await serve_root(sup, stop, notifier, shutdown_timeout=sc.shutdown_timeout + pool.sleep.drain_timeout)
    finally:
        bus_lost = lost.done() and not lost.cancelled()
        await cancel_and_wait([lost])
        if status is not None:
            await status.stop()
        await service.stop()
        await ctx.close()
        tracing.shutdown()  # what is buffered leaves before the process does
    if bus_lost:
        log.error("worker %s: its NATS connection was closed for good; exiting so it is restarted", node)
        return EXIT_FAILED
    # EXIT_CONFIG: the engine's configuration is rejected; the root stops retrying after a few
    return code if code in (EXIT_OK, EXIT_CONFIG) else EXIT_FAILED


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m actors.worker.process", description=__doc__.splitlines()[0])
    p.add_argument("--topology", required=True, help="topology TOML file")
    p.add_argument("--pool", required=True, help="pool name in the topology")
    p.add_argument("--replica", type=int, default=0, help="replica index in the pool")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a topology value (repeatable), e.g. pools.agg.engine=mocker")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{args.pool}-{args.replica}] %(name)s: %(message)s")
    try:
        # the supervisor's overrides come by environment (they may hold secrets), ours after them
        t = load_topology(args.topology, [*overrides_from_env(), *args.overrides])
    except ValueError as e:  # a TopologyError, or a malformed VLLM_ACTORS_SET
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.pool not in t.pools:
        print(f"error: no pool {args.pool!r} in {args.topology} (pools: {', '.join(t.pools) or 'none'})",
              file=sys.stderr)
        return EXIT_USAGE
    # replicas beyond pools.<p>.replicas are legal: a pool scaled up at run time (spawn)
    if not 0 <= args.replica <= MAX_REPLICA:
        print(f"error: replica {args.replica} out of range (0..{MAX_REPLICA})", file=sys.stderr)
        return EXIT_USAGE
    try:
        given_instance(args.pool, args.replica)  # a malformed instance from the root: a usage error
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return event_loop.run(run_worker(t, args.pool, args.replica))


if __name__ == "__main__":
    exit_process(main())
