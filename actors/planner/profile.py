"""``python -m actors.planner.profile TOPOLOGY --pool NAME``: measure one worker of a pool and write
the profile the planner's throughput mode reads (``actors.planner.contract.Profile``, JSON).

    --set KEY.PATH=VALUE   override a topology value, as for the supervisor (repeatable)
    --isl 128,512,1024,2048        prompt lengths
    --concurrency 1,2,4,8,16       requests in flight
    --osl 64                       tokens each decode request generates
    --requests-per-point N         default max(8, 4 x concurrency)
    --out FILE                     default: the file the planner reads (config.paths.profile_path:
                                   planner.pools.<pool>.profile, else <profile_dir>/<pool>.json,
                                   profile_dir defaulting to <run_dir>/profiles)

The run is a world of its own, so it never meets a deployment running on this host: a private
nats-server on a free loopback port, a private namespace and run dir (removed at the end), and one
worker process of the pool, started as the root supervisor starts it (``config.workers``) with
overrides that point it at that server. Its status port, if the pool has one, moves to a free port;
its bus credentials are dropped (the private server has none), and a prefill pool's worker runs
as agg (no decode engine would ever pull the KV a prefill engine keeps for it). The sweep talks to
the worker's own generate subject over NATS (``actors.planner.sweep``). Prefill pools get prefill
points, decode pools decode points, agg pools both.

Exit codes: 0 written, 1 the worker or a measurement failed, 2 bad command line or topology,
130 interrupted (everything started is stopped first; no file is written).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from actors.engines.mocker.config import MockerArgs
from actors.instances.contract import WORKER_KIND, InstanceRecord, ModelCard
from actors.planner import sweep as S
from actors.planner.constraints import replica_engines
from actors.planner.contract import Profile
from actors.worker.contract import GenerateChunk, GenerateRequest
from bus import event_loop
from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats
from bus.stream import StreamCall, stream_request
from config.loader import TopologyError, load_topology
from config.paths import profile_path
from config.topology import PoolConfig, Topology
from config.workers import worker_argv, worker_child_id, worker_env
from supervisors.process import ProcessChild

log = logging.getLogger("actors.planner.profile")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
PROG = "python -m actors.planner.profile"
REPLICA = 0  # the profiled worker is its pool's first replica (its CPU slot, its ports)
STALL_TIMEOUT = 30.0  # silence (no chunk, no heartbeat) after which a request counts as lost
RECORD_TIMEOUT = 15.0  # READY comes after registration; this only covers a slow registry read
# --set keys whose values are not written into the profile's made_by
_SECRET_KEY = re.compile(r"auth|password|token|secret|creds|nkey|api_key", re.IGNORECASE)


class UsageError(ValueError):
    """The command line or topology cannot be profiled (exit 2)."""


def int_list(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description="Measure one worker of a pool (TTFT vs prompt "
                                "length, ITL vs concurrency and context) and write the planner's profile.")
    p.add_argument("topology", help="topology TOML file")
    p.add_argument("--pool", required=True, help="the pool to profile")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a topology value (repeatable)")
    p.add_argument("--isl", type=int_list, default=[128, 512, 1024, 2048], metavar="N,N,...",
                   help="prompt lengths (default 128,512,1024,2048)")
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], metavar="N,N,...",
                   help="requests in flight (default 1,2,4,8,16)")
    p.add_argument("--osl", type=positive, default=64,
                   help="tokens each decode request generates (default 64; a decode point's context "
                        "is ISL + OSL/2)")
    p.add_argument("--requests-per-point", type=positive, default=None, metavar="N",
                   help="requests per point (default max(8, 4 x concurrency); decode points run "
                        "whole waves of `concurrency` requests)")
    p.add_argument("--out", help="profile file to write (default: the file the planner reads)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def made_by(argv: list[str]) -> str:
    """The command line, with the values of secret-looking ``--set`` keys hidden."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next:
            a, hide_next = _hide(a), False
        elif a == "--set":
            hide_next = True
        elif a.startswith("--set="):
            a = "--set=" + _hide(a.removeprefix("--set="))
        out.append(a)
    return shlex.join(["python", "-m", "actors.planner.profile", *out])


def _hide(item: str) -> str:
    key, sep, _ = item.partition("=")
    return f"{key}=***" if sep and _SECRET_KEY.search(key) else item


# --- the private world ------------------------------------------------------------------------------
@dataclass(frozen=True)
class World:
    """Where the profile run lives: its own namespace, server port and run dir."""

    namespace: str
    port: int
    run_dir: Path

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


def private_overrides(t: Topology, pool: str, world: World) -> list[str]:
    """What the worker (and our own view of the topology) gets on top of the user's ``--set``s."""
    if t.bus.tls is not None:
        raise UsageError("bus.tls: the profiler runs a private plaintext nats-server on 127.0.0.1, "
                         "which a worker set up for TLS cannot join; profile with a copy of the "
                         "topology without [bus.tls] (the engine's speed does not depend on it)")
    sets = [f"namespace={world.namespace}", f"run_dir={world.run_dir}", f"bus.url={world.url}",
            f"bus.port={world.port}"]
    # the private server admits anyone on loopback: no credential of the deployment is sent to it
    if t.bus.auth.kind() is not None:
        sets.append("bus.auth={}")
    if t.bus.worker_auth is not None:
        sets.append("bus.worker_auth={}")
    if t.bus.scoped_workers:  # no root answers a callout there: the worker joins as anyone may
        sets.append("bus.scoped_workers=false")
    if t.pools[pool].status_port is not None:
        sets.append(f"pools.{pool}.status_port=0")  # a port the kernel picks (none of a deployment's)
    if t.pools[pool].role == "prefill":
        # measured as agg: a prefill engine keeps each prompt's KV for the decode engine that is to
        # pull it (vLLM's NIXL connector, until pulled or timed out), and none ever comes here; with
        # one-token requests agg computes exactly what prefill does
        sets.append(f"pools.{pool}.role=agg")
    return sets


def load(args: argparse.Namespace, world: World) -> tuple[Topology, Topology, list[str]]:
    """(the topology as given, as the worker sees it, the worker's overrides); UsageError or
    TopologyError when it cannot be profiled."""
    t = load_topology(args.topology, args.overrides)
    if args.pool not in t.pools:
        raise UsageError(f"{args.topology}: no pool {args.pool!r} (pools: {', '.join(t.pools) or 'none'})")
    if t.pools[args.pool].checkpoint.control_dir:
        raise UsageError(f"pools.{args.pool}.checkpoint: a checkpoint pool's worker waits for a "
                         f"snapshotter; profile a copy of the pool without [checkpoint]")
    overrides = [*args.overrides, *private_overrides(t, args.pool, world)]
    return t, load_topology(args.topology, overrides), overrides


def max_num_seqs(pool: PoolConfig) -> int:
    """Running requests one engine admits: the engine args', else the engine's default."""
    args = pool.engine_args
    if pool.engine == "mocker":
        return MockerArgs.from_dict(args).max_num_seqs
    if args.get("max_num_seqs"):
        return int(args["max_num_seqs"])
    from vllm.config import SchedulerConfig

    # the worker builds its engine config with UsageContext.ENGINE_CONTEXT, for which vLLM has no
    # hardware-specific default: it takes SchedulerConfig's (doubled in throughput mode, capped by
    # the token budget)
    n = int(SchedulerConfig.DEFAULT_MAX_NUM_SEQS)
    if args.get("performance_mode") == "throughput":
        n *= 2
    if args.get("max_num_batched_tokens"):
        n = min(n, int(args["max_num_batched_tokens"]))
    return n


def mocker_avoid(pool: PoolConfig) -> frozenset[int]:
    """Token ids a prompt must not hold: the mocker's poison id kills its worker by design."""
    if pool.engine != "mocker":
        return frozenset()
    poison = MockerArgs.from_dict(pool.engine_args).poison_token_id
    return frozenset() if poison is None else frozenset({poison})


# --- the worker -------------------------------------------------------------------------------------
@dataclass
class WorkerTarget:
    """``sweep.Target`` bound to one worker's routed generate subject."""

    bus: BusContext
    subject: str

    def stream(self, req: GenerateRequest) -> StreamCall:
        return stream_request(self.bus.nc, self.subject, req, stall_timeout=STALL_TIMEOUT, msgpack=True,
                              chunk_type=GenerateChunk)


async def registered(bus: BusContext, pool: str) -> tuple[InstanceRecord, ModelCard]:
    """The worker's instance record and model card, read from the private registry."""
    instances = bus.registry(bus.subjects.bucket_instances)
    models = bus.registry(bus.subjects.bucket_models)
    await instances.ensure()
    await models.ensure()
    loop = asyncio.get_running_loop()
    end = loop.time() + RECORD_TIMEOUT
    while True:
        recs = [r for r in (msgspec.json.decode(v, type=InstanceRecord) for v in (await instances.items()).values())
                if r.kind == WORKER_KIND and r.pool == pool and r.status == "ready" and r.generate_subject]
        cards = [c for c in (msgspec.json.decode(v, type=ModelCard) for v in (await models.items()).values())
                 if c.pool == pool]
        if recs and cards:
            return recs[0], cards[0]
        if loop.time() > end:
            raise RuntimeError(f"the worker of pool {pool} is up but its registry record or model card "
                               f"did not appear within {RECORD_TIMEOUT:g}s")
        await asyncio.sleep(0.2)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- the run ----------------------------------------------------------------------------------------
def print_row(kind: str, size: int, concurrency: int, requests: int, ms: float, tps: float) -> None:
    print(f"{kind:<8} {size:>8} {concurrency:>5} {requests:>9} {ms:>12.2f} {tps:>12.1f}", flush=True)


async def measure(args: argparse.Namespace, t: Topology, bus: BusContext,
                  rec: InstanceRecord, card: ModelCard, command: str) -> Profile:
    pool = t.pools[args.pool]  # the pool as deployed (the worker may run a prefill pool as agg)
    dp = max(1, card.dp_size)
    # one worker process is one replica: its data-parallel ranks together
    limits = S.Limits(max_model_len=card.context_length,
                      kv_capacity_tokens=card.total_kv_blocks * card.kv_block_size * dp,
                      max_num_seqs=max_num_seqs(pool) * dp)
    if not limits.kv_capacity_tokens:
        log.warning("the worker reports no KV capacity; points are not checked against it")
    sweep = S.Sweep(isls=args.isl, concurrencies=args.concurrency, osl=args.osl,
                    requests=args.requests_per_point, prefill=pool.role != "decode",
                    decode=pool.role != "prefill")
    points, skipped = S.plan(sweep, limits)
    log.info("profiling pool %s (%s, %s engine, model %s): max_model_len %d, KV capacity %d tokens, "
             "max_num_seqs %d; %d points", args.pool, pool.role, pool.engine, card.served_model_name,
             limits.max_model_len, limits.kv_capacity_tokens, limits.max_num_seqs, len(points))
    for p, why in skipped:
        log.warning("skip %s: %s", p.describe(args.osl), why)
    if not points:
        raise UsageError("no point of the sweep fits this engine (see the skipped points above)")

    def cached(what: str, tokens: int) -> None:
        log.warning("%s: the engine found %d prompt tokens cached; the prompts should share no prefix",
                    what, tokens)

    sweeper = S.Sweeper(WorkerTarget(bus, rec.generate_subject or ""),
                        S.Prompts(vocab_size=card.vocab_size or 32000, avoid=mocker_avoid(pool),
                                  seed=secrets.randbits(32)),
                        osl=args.osl, on_cached=cached)
    await sweeper.warm_up(min(p.isl for p in points), decode=sweep.decode)
    prof = Profile(pool=args.pool, role=pool.role, engine=pool.engine, model=card.served_model_name,
                   made_by=command, made_at=time.time(), engines_per_replica=replica_engines(t.planner, args.pool, t.pools[args.pool]),
                   kv_capacity_tokens=limits.kv_capacity_tokens, max_num_seqs=limits.max_num_seqs)
    print(f"{'point':<8} {'isl/ctx':>8} {'conc':>5} {'requests':>9} {'TTFT/ITL ms':>12} {'tokens/s':>12}",
          flush=True)
    for p in points:
        n = sweep.requests_for(p.concurrency)
        if p.kind == "prefill":
            pre = await sweeper.prefill(p.isl, p.concurrency, n)
            prof.prefill.append(pre)
            print_row("prefill", pre.isl, pre.concurrency, n, pre.ttft_ms, pre.tokens_per_s)
        else:
            n = math.ceil(n / p.concurrency) * p.concurrency  # whole waves
            dec = await sweeper.decode(p.isl, p.concurrency, n)
            prof.decode.append(dec)
            print_row("decode", dec.context, dec.concurrency, n, dec.itl_ms, dec.tokens_per_s)
    return prof


def write(prof: Profile, out: Path) -> None:
    """Whole or not at all: a planner reading the file meanwhile sees the old one or the new one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(prof), indent=2) + b"\n")
    os.replace(tmp, out)


async def run(args: argparse.Namespace, command: str) -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="vllm-actors-profile-"))
    # port 0: the server binds one the kernel picks and reports it (no port picked, then raced for)
    nats = EmbeddedNats(port=0, store_dir=str(run_dir / "nats"), log_file=str(run_dir / "nats.log"),
                        name="profile-nats")
    try:
        try:
            await nats.start()
        except Exception as e:
            print(f"error: starting the private nats-server: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_FAILED
        world = World(namespace=f"profile{secrets.token_hex(4)}", port=nats.port, run_dir=run_dir)
        try:
            t, worker_t, overrides = load(args, world)
        except (TopologyError, UsageError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        out = Path(args.out).expanduser() if args.out else profile_path(t, args.pool)
        return await _run(args, command, t, worker_t, overrides, world, out)
    finally:
        # on Ctrl-C too: nothing of ours outlives the run
        await nats.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


async def _run(args: argparse.Namespace, command: str, t: Topology, worker_t: Topology,
               overrides: list[str], world: World, out: Path) -> int:
    pool = worker_t.pools[args.pool]
    worker_log = world.run_dir / "worker.log"
    worker = ProcessChild(worker_child_id(args.pool, REPLICA), worker_argv(args.topology, args.pool, REPLICA),
                          env=worker_env(worker_t, pool, overrides), log_file=str(worker_log),
                          ready_timeout=60.0 if pool.engine == "mocker" else 900.0)
    bus: BusContext | None = None
    stage = "starting the worker"
    try:
        log.info("starting a %s worker of pool %s (private namespace %s, log %s)", pool.engine, args.pool,
                 world.namespace, worker_log)
        await worker.start()
        stage = "reading the worker's registry record"
        bus = await open_context(world.url, world.namespace, "profile", f"vllm-actors:profile:{os.getpid()}")
        rec, card = await registered(bus, args.pool)
        stage = "measuring"
        prof = await measure(args, t, bus, rec, card, command)
        stage = f"writing {out}"
        write(prof, out)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        log.debug("%s failed", stage, exc_info=True)
        print(f"error: {stage}: {type(e).__name__}: {e}", file=sys.stderr)
        if worker.pid is not None:
            print(f"the worker's last log lines:\n{tail(worker_log)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        # on Ctrl-C too: nothing of ours outlives the run (a second Ctrl-C leaves the rest to the
        # children's parent-death signals)
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        await worker.stop(pool.supervisor.shutdown_timeout + pool.sleep.drain_timeout)
    print(f"wrote {out}", flush=True)
    return EXIT_OK


async def main_async(args: argparse.Namespace, command: str) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    interrupted: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        interrupted.append(sig)
        if len(interrupted) == 1:
            log.warning("%s: stopping the worker and the private nats-server", sig.name)
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await run(args, command)
    except asyncio.CancelledError:
        if not interrupted:
            raise
        print("interrupted: no profile written", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(args.log_level)
    return event_loop.run(main_async(args, made_by(argv)))


if __name__ == "__main__":
    sys.exit(main())
