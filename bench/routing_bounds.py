"""What any router could reach on two of bench/routing_bench.py's workloads, in simulated time.

    .venv/bin/python bench/routing_bounds.py [--part cold_burst,multi_turn] [--restarts 15]

Both parts drive the mocker's own scheduler and timing model (``actors/engines/mocker``: the
same ``Scheduler``, ``BlockPool`` and ``TimingModel`` the benchmark's workers run, sized by
``topologies/mocker-kv.toml``) with no CPU, NATS or HTTP in the way, so what they print is the
engines' share of TTFT under a given assignment of requests to workers.

- ``cold_burst``: the shared-prefix workload's first ``concurrency`` requests (the very prompts
  routing_bench sends), all arriving at once on empty caches. The plain TTFT p99 of a 1,024-request
  run is its 11th slowest request, and in every measured run those were all in this burst. Printed
  per assignment: the burst's slowest TTFT and its ``k``-th slowest (k = the p99's rank in the
  whole run). Assignments: round robin; an online greedy (a repeated prefix joins the worker that
  computes it, anything else goes to the worker with the fewest tokens queued); online with a
  perfect predictor (each request, in send order, to the worker where the simulation gives it the
  lowest TTFT); and the best found offline, knowing the whole burst, by local search over which
  worker each prefix group goes to (a group's members kept together), once minimising the slowest
  request and once the k-th slowest.
- ``multi_turn``: the closed loop of routing_bench's multi_turn (64 sessions × 6 turns, 32 active,
  64 output tokens; turn 1 ~1,000 prompt tokens, each later turn appends the reply and ~110 new
  tokens; the reply's tokens never hit, as the next prompt re-tokenizes it). A turn reaches its
  worker ``--gap`` ms plus up to one of ``--jitters`` ms (uniform) after the previous turn's last token:
  the client's and the frontend's work between two turns. Policies: round robin; sticky (a session
  stays on the worker its first turn took, the one that has taken the fewest sessions); and a
  latency-first router with perfect knowledge that no real router has (each worker's step in
  flight and its exact waiting queue and cache), which picks the lowest predicted TTFT plus
  ``lambda`` × the prefill time it would compute that another worker holds cached, per stream
  running there (the ITL it costs them).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engines.mocker.kv_pool import BlockPool  # noqa: E402
from actors.engines.mocker.ranks import Rank  # noqa: E402
from actors.engines.mocker.scheduler import MockRequest, Scheduler, StepResult  # noqa: E402
from actors.engines.mocker.timing import TimingModel, decode_ms, prefill_ms  # noqa: E402
from bench.routing_bench import Topo, read_topology  # noqa: E402
from bench.shared_prefix import build_workload  # noqa: E402

VOCAB = (100, 30000)  # token ids drawn for the multi-turn prompts and the mocker's replies
PREFIX_TOKENS = 2048  # routing_bench's shared_prefix: a group prefix + a 128-token question


@dataclass
class Engine:
    """One simulated worker: a mocker rank (pool and scheduler, no KV-event publisher), and when its
    step in flight ends."""

    rank: Rank
    busy_until: float | None = None  # None: idle

    @classmethod
    def build(cls, topo: Topo, rng: random.Random) -> Engine:
        pool = BlockPool(topo.num_gpu_blocks, topo.block_size, True, emit_events=False)
        sched = Scheduler(pool, max_num_seqs=topo.max_num_seqs, max_num_batched_tokens=topo.max_num_batched_tokens,
                          max_model_len=1 << 20, enable_chunked_prefill=True, max_loras=1,
                          sample=lambda _req: rng.randrange(*VOCAB))
        return cls(Rank(0, pool, sched, None))

    @property
    def pool(self) -> BlockPool:
        return self.rank.pool

    @property
    def sched(self) -> Scheduler:
        return self.rank.sched

    def step(self, timing: TimingModel) -> tuple[StepResult, float]:
        """One scheduler step and its simulated seconds, priced as the mocker's engine loop does."""
        res = self.sched.step()
        held = self.rank.blocks_in_step(res)
        return res, timing.step_seconds(res.prefill_tokens, res.num_decode, held, self.pool.num_blocks)


# --- cold burst ------------------------------------------------------------------------------------
def burst_ttfts(topo: Topo, prompts: Sequence[list[int]], assignment: Sequence[int],
                output_tokens: int = 64) -> list[float]:
    """TTFT (ms) of each request when all arrive at t = 0 on empty workers, in send order per worker."""
    timing, out = TimingModel(topo.speedup_ratio), [math.nan] * len(prompts)
    for w in range(topo.workers):
        eng = Engine.build(topo, random.Random(0))
        mine = [i for i, a in enumerate(assignment) if a == w]
        for i in mine:
            eng.sched.add(MockRequest(request_id=str(i), prompt=list(prompts[i]), max_tokens=output_tokens))
        t, left = 0.0, set(mine)
        while left:
            res, dt = eng.step(timing)
            t += dt
            for req, _tok in res.sampled:
                i = int(req.request_id)
                if i in left:
                    out[i] = t * 1000.0
                    left.discard(i)
    return out


def slowest(ttfts: Sequence[float], k: int) -> tuple[float, float, float]:
    """(slowest, k-th slowest, mean)."""
    s = sorted(ttfts, reverse=True)
    return s[0], s[k - 1], statistics.fmean(s)


def greedy(topo: Topo, prompts: Sequence[list[int]], groups: Sequence[int]) -> list[int]:
    """Online: a repeated group joins its worker (only the question is new), a new one the least loaded."""
    queued, home, out = [0] * topo.workers, {}, []
    for p, g in zip(prompts, groups, strict=True):
        if g in home:
            w = home[g]
            queued[w] += len(p) - PREFIX_TOKENS
        else:
            w = home[g] = min(range(topo.workers), key=lambda x: queued[x])
            queued[w] += len(p)
        out.append(w)
    return out


def fastest_first(topo: Topo, prompts: Sequence[list[int]]) -> list[int]:
    """Online with a perfect predictor: each request, in send order, to the worker where its own TTFT
    (simulated with the requests already placed) is lowest."""
    out: list[int] = []
    for i in range(len(prompts)):
        def own(w: int) -> float:
            return burst_ttfts(topo, prompts[:i + 1], [*out, w])[i]  # noqa: B023
        out.append(min(range(topo.workers), key=own))
    return out


def best_offline(topo: Topo, prompts: Sequence[list[int]], groups: Sequence[int], k: int, restarts: int,
                 key: Callable[[tuple[float, float, float]], tuple[float, ...]]) -> tuple[float, float, float]:
    """Local search over group -> worker (random restarts, single moves) minimising ``key``."""
    rng, gs = random.Random(1), sorted(set(groups))
    best: tuple[float, float, float] | None = None
    for _ in range(restarts):
        home = {g: rng.randrange(topo.workers) for g in gs}

        def score() -> tuple[float, float, float]:
            return slowest(burst_ttfts(topo, prompts, [home[g] for g in groups]), k)  # noqa: B023

        cur, moved = score(), True
        while moved:
            moved = False
            for g in gs:
                for w in range(topo.workers):
                    was = home[g]
                    if w == was:
                        continue
                    home[g] = w
                    v = score()
                    if key(v) < key(cur):
                        cur, moved = v, True
                    else:
                        home[g] = was
        if best is None or key(cur) < key(best):
            best = cur
    assert best is not None
    return best


def cold_burst(topo: Topo, a: argparse.Namespace) -> None:
    # routing_bench's shared_prefix workload at scale 1 (its prompts, in its send order)
    w = build_workload(argparse.Namespace(groups=64, per_group=16, prefix_tokens=PREFIX_TOKENS, question_tokens=128,
                                          seed=a.seed))
    prompts, groups = w.prompts[:a.concurrency], w.groups[:a.concurrency]
    k = len(w.prompts) - math.ceil(0.99 * len(w.prompts)) + 1  # the p99's rank from the top in the whole run
    print(f"cold burst: the first {a.concurrency} of {len(w.prompts)} shared-prefix requests at once, "
          f"{len(set(groups))} distinct prefixes; TTFT ms (slowest, {k}th slowest = the run's p99 rank, mean)")
    rr = slowest(burst_ttfts(topo, prompts, [i % topo.workers for i in range(len(prompts))]), k)
    rows = {"round robin": rr, "online greedy": slowest(burst_ttfts(topo, prompts, greedy(topo, prompts, groups)), k),
            "online, fastest own TTFT": slowest(burst_ttfts(topo, prompts, fastest_first(topo, prompts)), k),
            "best offline, min slowest": best_offline(topo, prompts, groups, k, a.restarts, lambda v: v[:2]),
            f"best offline, min {k}th": best_offline(topo, prompts, groups, k, a.restarts, lambda v: (v[1], v[0]))}
    for name, (top, kth, mean) in rows.items():
        print(f"  {name:28s} slowest {top:4.0f} ({top / rr[0]:.2f}x rr)  {k}th {kth:4.0f} ({kth / rr[1]:.2f}x rr)  "
              f"mean {mean:4.0f} ({mean / rr[2]:.2f}x rr)")


# --- multi-turn closed loop ------------------------------------------------------------------------
@dataclass
class Session:
    turns: list[list[int]]  # turn 1's prompt, then each later turn's new tokens
    turn: int = 0
    prompt: list[int] = field(default_factory=list)
    home: int | None = None


@dataclass(frozen=True)
class LoopResult:
    ttft_p50: float
    ttft_p99: float
    hit_rate: float
    makespan: float
    turns: int  # first tokens seen: every turn of every session once the loop ends


def multi_turn_loop(topo: Topo, policy: str, lam: float, a: argparse.Namespace) -> LoopResult:
    rng = random.Random(a.seed)
    timing = TimingModel(topo.speedup_ratio)
    sessions = [Session([[rng.randrange(*VOCAB) for _ in range(1000)]]
                        + [[rng.randrange(*VOCAB) for _ in range(110)] for _ in range(a.turns - 1)])
                for _ in range(a.sessions)]
    engines = [Engine.build(topo, rng) for _ in range(topo.workers)]
    in_flight: dict[int, StepResult] = {}  # worker -> its step in flight
    events: list[tuple[float, int, str, int]] = []  # (time, tie-break, "send"|"step"|"end", session|worker)
    sent: dict[str, tuple[float, int]] = {}  # request id -> (time sent, session)
    ttfts: list[float] = []
    counts = {"seq": 0, "rr": 0, "cached": 0, "prompt": 0}

    def at(t: float, kind: str, what: int) -> None:
        counts["seq"] += 1
        heapq.heappush(events, (t, counts["seq"], kind, what))

    def choose(s: Session, t: float) -> int:
        if policy == "round_robin":
            counts["rr"] += 1
            return (counts["rr"] - 1) % topo.workers
        if policy == "sticky":
            if s.home is None:
                taken = [sum(1 for x in sessions if x.home == w) for w in range(topo.workers)]
                s.home = min(range(topo.workers), key=lambda w: taken[w])
            return s.home
        probe = MockRequest(request_id="probe", prompt=s.prompt, max_tokens=1)
        probe.update_hashes(topo.block_size)
        own = [len(s.prompt) - len(e.pool.lookup(probe.block_hashes)) * topo.block_size for e in engines]

        def cost(w: int) -> float:
            e = engines[w]
            left = max(0.0, e.busy_until - t) * 1000.0 if e.busy_until is not None else 0.0
            queued = sum(len(r.prompt) - r.num_computed for r in e.sched.waiting)
            decode = decode_ms(e.pool.num_used, e.pool.num_blocks) if e.sched.running else 0.0
            avoidable = prefill_ms(own[w]) - prefill_ms(min(own))
            return left + prefill_ms(queued + own[w]) + decode + lam * avoidable * max(1, len(e.sched.running))

        return min(range(topo.workers), key=cost)

    def send(t: float, i: int) -> None:
        s = sessions[i]
        s.prompt = s.prompt + s.turns[s.turn] if s.turn else list(s.turns[0])
        s.turn += 1
        w = choose(s, t)
        rid = f"{i}:{s.turn}"
        engines[w].sched.add(MockRequest(request_id=rid, prompt=list(s.prompt), max_tokens=a.output_tokens))
        sent[rid] = (t, i)
        if engines[w].busy_until is None:
            at(t, "step", w)

    def next_turn_at(t: float) -> float:
        return t + (a.gap + rng.random() * a.jitter) / 1000.0

    queue = list(range(a.sessions))
    for _ in range(min(a.active, a.sessions)):
        send(0.0, queue.pop(0))
    t = 0.0
    while events:
        t, _, kind, what = heapq.heappop(events)
        if kind == "send":
            send(t, what)
            continue
        e = engines[what]
        if kind == "step":
            if e.busy_until is None and e.sched.has_work():
                in_flight[what], dt = e.step(timing)
                e.busy_until = t + dt
                at(t + dt, "end", what)
            continue
        e.busy_until, res = None, in_flight.pop(what)
        for req, _tok in res.sampled:
            if len(req.output) == 1:
                ttfts.append((t - sent[req.request_id][0]) * 1000.0)
                counts["cached"] += req.cached_tokens or 0
                counts["prompt"] += len(req.prompt)
        for req in res.finished:
            i = sent[req.request_id][1]
            s = sessions[i]
            if s.turn < a.turns:
                # the next prompt re-tokenizes the reply: other ids, so its KV is never reused
                s.prompt = s.prompt + [rng.randrange(*VOCAB) for _ in req.output]
                at(next_turn_at(t), "send", i)
            elif queue:
                at(next_turn_at(t), "send", queue.pop(0))
        if e.sched.has_work():
            at(t, "step", what)
    ttfts.sort()
    return LoopResult(statistics.median(ttfts), ttfts[math.ceil(0.99 * len(ttfts)) - 1],
                      counts["cached"] / counts["prompt"], t, len(ttfts))


def median_loop(topo: Topo, policy: str, lam: float, a: argparse.Namespace) -> LoopResult:
    """The per-field medians over ``--seeds`` seeds (the closed loop is chaotic: one seed's p50 moves)."""
    runs = [multi_turn_loop(topo, policy, lam, argparse.Namespace(**{**vars(a), "seed": a.seed + k}))
            for k in range(a.seeds)]
    return LoopResult(*(statistics.median(getattr(r, f) for r in runs)
                        for f in ("ttft_p50", "ttft_p99", "hit_rate", "makespan")), turns=runs[0].turns)


def multi_turn(topo: Topo, a: argparse.Namespace) -> None:
    print(f"multi-turn closed loop: {a.sessions} sessions x {a.turns} turns, {a.active} active, {a.output_tokens} "
          f"output tokens; medians over {a.seeds} seeds of TTFT ms, hit = cached / prompt tokens and makespan = "
          f"simulated seconds for all turns")
    for jitter in a.jitters:
        a.jitter = jitter
        rr = median_loop(topo, "round_robin", 0.0, a)
        print(f"  next turn {a.gap:g} + U(0, {jitter:g}) ms after the last token:")
        rows = [("round robin", rr), ("sticky", median_loop(topo, "sticky", 0.0, a))]
        rows += [(f"latency-first, lambda {lam:g}", median_loop(topo, "latency", lam, a)) for lam in a.lambdas]
        for name, r in rows:
            print(f"    {name:26s} p50 {r.ttft_p50:5.1f} ({r.ttft_p50 / rr.ttft_p50:.2f}x rr)  p99 {r.ttft_p99:5.0f}  "
                  f"hit {100 * r.hit_rate:4.1f} %  makespan {r.makespan:5.2f} s")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="cold_burst,multi_turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=32, help="cold burst: requests at once")
    p.add_argument("--restarts", type=int, default=15, help="cold burst: local-search restarts per objective")
    p.add_argument("--seeds", type=int, default=5, help="multi-turn: seeds per figure (medians)")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--active", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--gap", type=float, default=5.0, help="multi-turn: ms from a turn's last token to the next turn")
    p.add_argument("--jitters", type=floats, default=[0.0, 5.0, 10.0, 20.0], help="multi-turn: ms, comma-separated")
    p.add_argument("--lambdas", type=floats, default=[0.0, 0.5, 1.0, 2.0], help="multi-turn: comma-separated")
    a = p.parse_args()
    topo = read_topology()
    parts = a.part.split(",")
    if "cold_burst" in parts:
        cold_burst(topo, a)
    if "multi_turn" in parts:
        multi_turn(topo, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
