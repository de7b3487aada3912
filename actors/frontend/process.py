"""One frontend OS process of several (``frontend.processes`` > 1):

    python -m actors.frontend.process --topology PATH --index I --supervisors HOST[,HOST...]

The root supervisor starts N of these (``deploy.frontends``). The root accepts on ``frontend.http``
and hands each connection to a process over a Unix socket pair, whose end each process inherits
(its descriptor number in ``VLLM_ACTORS_HANDOFF_FD``; ``actors.frontend.handoff``). Each process has
its own NATS connection and its own supervisor (one child: the FrontendActor, instance
``frontend-<host>-<I>``), served as ``ns.supervisor.<host>.frontend-<I>.*``. It tells the root
READY=1 once it serves HTTP, and exits 1 when its supervisor gives up or its connection is closed
for good, so the root restarts it; the root and the other frontend processes go on meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

from bus import event_loop, tracing
from bus.connection import until_closed
from bus.context import open_context
from bus.process_exit import exit_process
from bus.tasks import cancel_and_wait
from config.loader import load_topology
from config.topology import Topology
from config.workers import (
    HANDOFF_FD_ENV,
    frontend_child_id,
    frontend_instance,
    kv_replicas,
    overrides_from_env,
)
from supervisors.child import ChildSpec
from supervisors.sdnotify import Notifier, serve_root
from supervisors.service import SupervisorService
from supervisors.supervisor import Supervisor

from . import preprocess
from .actor import FrontendActor

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


async def run_frontend(t: Topology, index: int, sock: socket.socket, supervisors: list[str], *,
                       stop: asyncio.Event | None = None, notifier: Notifier | None = None) -> int:
    fe = t.frontend
    node = frontend_child_id(index)
    stop = stop or asyncio.Event()
    tracing.configure(t.tracing, service="vllm-actors-frontend", namespace=t.namespace,
                      instance=frontend_instance(fe.host, index))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    notifier = notifier or Notifier()
    notifier.status("connecting to NATS")
    ctx = await open_context(t.bus, t.namespace, fe.host, f"vllm-actors:{t.namespace}:{node}:{os.getpid()}",
                             kv_replicas(t))

    def start() -> FrontendActor:
        return FrontendActor(ctx.child(), config=fe, model_config=t.model, instance=frontend_instance(fe.host, index),
                             pools=t.pools, supervisor_hosts=supervisors, on_status=notifier.status, link=sock,
                             planner=t.planner)

    sc = t.supervisor
    sup = Supervisor(node, [ChildSpec("frontend", start, "permanent", sc.drain_timeout)], strategy="one_for_one",
                     intensity=sc.intensity, period=sc.period,
                     backoff={"initial": sc.backoff.initial, "max": sc.backoff.max,
                              "multiplier": sc.backoff.multiplier, "jitter": sc.backoff.jitter})
    service = SupervisorService(ctx, sup, node=node)
    await service.start()
    lost = asyncio.create_task(until_closed(ctx.nc), name="bus-closed-watch")
    lost.add_done_callback(lambda _t: stop.set())
    try:
        code = await serve_root(sup, stop, notifier, shutdown_timeout=sc.shutdown_timeout)
    finally:
        bus_lost = lost.done() and not lost.cancelled()
        await cancel_and_wait([lost])
        await service.stop()
        await ctx.close()
        tracing.shutdown()  # what is buffered leaves before the process does
    if bus_lost:
        log.error("frontend %s: its NATS connection was closed for good; exiting so it is restarted", node)
        return EXIT_FAILED
    return EXIT_OK if code == 0 else EXIT_FAILED


def inherited_link(env: dict[str, str] | None = None) -> socket.socket:
    """This process's end of the connection hand-over with the root (actors.frontend.handoff)."""
    raw = (env if env is not None else os.environ).get(HANDOFF_FD_ENV)
    if raw is None or not raw.isdigit():
        raise ValueError(f"{HANDOFF_FD_ENV} must name the inherited hand-over socket's descriptor")
    sock = socket.socket(fileno=int(raw))
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        sock.detach()
        raise ValueError(f"descriptor {raw} is not the root's connection hand-over (a Unix SOCK_SEQPACKET socket)")
    return sock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actors.frontend.process", description=__doc__.splitlines()[0])
    p.add_argument("--topology", required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--index", type=int)
    which.add_argument("--standby", action="store_true",
                       help="import everything, then read the index from stdin (a warm standby)")
    p.add_argument("--supervisors", default="", help="roots whose children views /health reads (comma-separated)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format=_log_format(args.index))
    try:
        t = load_topology(args.topology, overrides_from_env())
        sock = inherited_link()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    index = args.index
    if args.standby:
        index = await_index(t)
        if index is None:
            return EXIT_OK  # the root stopped (or replaced) the standby before it was needed
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter(_log_format(index)))
        log.info("standby taken: serving as frontend process %d", index)
    return event_loop.run(run_frontend(t, index, sock, [h for h in args.supervisors.split(",") if h]))


def _log_format(index: int | None) -> str:
    name = "frontend-standby" if index is None else frontend_child_id(index)
    return f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s"


def await_index(t: Topology) -> int | None:
    """A standby's wait: what a start would do before it serves is done now (the imports above, the
    tokenizer), then the index is read from stdin. None when stdin closes without one."""
    key = preprocess.tokenizer_key(t.model)
    if key is not None:
        try:
            preprocess.SHARED.get(key)
        except Exception as e:  # noqa: BLE001 - the frontend loads it again when it starts, and says why
            log.warning("standby: tokenizer not preloaded: %s", e)
    # the root's view shows it (deploy.frontends.Standby.status): warm from here on
    Notifier().status("standby: imported, waiting to be taken")
    line = sys.stdin.readline().strip()
    return int(line) if line.isdigit() else None


if __name__ == "__main__":
    exit_process(main())
