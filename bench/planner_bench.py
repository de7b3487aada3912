"""SLA planner benchmark: a request-rate trace replayed against topologies/mocker-planner.toml with
the planner (load and throughput modes) and without it (static peak and static minimal pools).

    .venv/bin/python bench/planner_bench.py [--configs load,throughput,static-peak,static-min]
        [--trace 1:60,1-10:60,10:90,10-1:60,1:90] [--arrivals poisson|even] [--isl 1024] [--osl 150]
        [--interval 10] [--planner-interval 5] [--throughput-interval 10] [--peak prefill=N,decode=M]
        [--profiles DIR]
        [--profile-args "--concurrency 1,2,4,8,16,32"] [--set KEY=VALUE ...] [--seed 0]
        [--out FILE.json] [--write docs/benchmarks.md]

Each configuration is a deployment started as a user starts one (``python -m actors.supervisor
topologies/mocker-planner.toml --set ...``: private bus and HTTP ports, namespace and run dir), waited
for (/health 200 with every pool's replicas registered), fed the trace, and stopped with SIGTERM
(its exit code is reported). Configurations:

- ``load``: the planner in load mode; ``throughput``: in throughput mode, from profiles made first
  with ``python -m actors.planner.profile TOPOLOGY --pool prefill|decode`` (same ``--set``s) into the
  run's profile dir (``--profiles DIR`` reuses existing ones). ``planner.interval``: load mode
  ``--planner-interval`` (5 s, its default), throughput mode ``--throughput-interval`` (10 s: its
  default of 180 s outlasts the trace's phases, and at 5 s its forecasts follow Poisson noise).
- ``static-peak``: planner disabled, each pool at the peak a planner run of this invocation reached
  (the smaller of the two modes' peaks, per pool; ``--peak`` sets them instead); ``static-min``:
  planner disabled, 1 + 1.

The trace: a piecewise rate schedule, ``RATE:SECONDS`` (constant) or ``R0-R1:SECONDS`` (linear ramp),
turned into open-loop arrivals (``poisson``: a non-homogeneous Poisson process; ``even``: evenly
spaced in expected count), the same arrival times and prompts for every configuration. Each request
is a streamed ``/v1/completions`` with a prompt of ``--isl`` random token ids (its own RNG: no prefix
is shared, so no KV-cache hits), ``max_tokens = --osl``, ``ignore_eos``.

Measured: per request TTFT (from the send to the first token), ITL (the request's mean gap between
tokens: (last - first token) / (tokens - 1)), failures (non-200, an error event, or fewer than
``--osl`` tokens). Every second: the root supervisor's ``children`` (replicas per pool, not stopped,
integrated into replica-seconds over the trace) and CPU seconds of this generator, the root process
(it hosts the frontend), the rest of the deployment's tree and the whole machine. The planner's
decisions (``<ns>.planner.decision``) are kept as published.

Per interval (``--interval`` s, requests by scheduled arrival): rate, requests, TTFT and ITL mean
and p90, and whether targets hold: *mean* = mean TTFT <= TTFT target and mean ITL <= ITL target and
no failure; *p90* = the same with p90s. Per configuration: the share of intervals holding after the
first adjustment (planner: intervals starting at or after the first decision that changed a count;
static: intervals starting at or after the trace's first rate change), replica-seconds and their
ratio to static-peak's, failures.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402
from bench.proc_cpu import kill_leftovers, machine_cpu, own_cpu, tree  # noqa: E402
from bench.sse import SseStream  # noqa: E402
from bus.subjects import Subjects  # noqa: E402
from tests.e2e.conftest import Deployment  # noqa: E402

TOPOLOGY = "mocker-planner.toml"  # in topologies/
POOLS = ("prefill", "decode")
HOST = "local"  # the root supervisor's host token in the single-host topology
MODEL = "tiny"
VOCAB = 2048  # the tiny model's tokenizer: prompt ids stay inside it
PLANNER_CONFIGS = ("load", "throughput")
SECTION = "SLA planner"
STREAM = {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
READING = "<!-- hand-written from here on: bench/planner_bench.py --write keeps it -->"


# --- the trace ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    start: float  # seconds from the trace's start
    seconds: float
    r0: float  # req/s at the segment's start
    r1: float  # and at its end (linear in between)

    def expected(self, tau: float) -> float:
        """Expected arrivals in the first ``tau`` seconds of the segment."""
        return self.r0 * tau + (self.r1 - self.r0) * tau * tau / (2 * self.seconds)

    def at_count(self, n: float) -> float:
        """The offset into the segment at which ``n`` arrivals are expected (inverse of ``expected``)."""
        k = (self.r1 - self.r0) / (2 * self.seconds)
        if abs(k) < 1e-12:
            return n / self.r0
        return (-self.r0 + math.sqrt(self.r0 * self.r0 + 4 * k * n)) / (2 * k)


def parse_trace(text: str) -> list[Segment]:
    out: list[Segment] = []
    t = 0.0
    for part in text.split(","):
        m = re.fullmatch(r"\s*([\d.]+)(?:-([\d.]+))?:([\d.]+)\s*", part)
        if not m:
            raise SystemExit(f"--trace: {part!r} is not RATE:SECONDS or R0-R1:SECONDS")
        r0 = float(m.group(1))
        r1 = float(m.group(2)) if m.group(2) is not None else r0
        d = float(m.group(3))
        if d <= 0:
            raise SystemExit(f"--trace: {part!r} lasts no time")
        out.append(Segment(t, d, r0, r1))
        t += d
    return out


def duration(trace: list[Segment]) -> float:
    return trace[-1].start + trace[-1].seconds


def arrivals(trace: list[Segment], kind: str, seed: int) -> list[float]:
    """Open-loop arrival times: the k-th arrival where the expected count reaches the k-th target
    (targets: cumulative Exp(1) draws for Poisson, 0.5, 1.5, 2.5, ... for evenly spaced)."""
    rng = random.Random(seed)
    out: list[float] = []
    target = rng.expovariate(1.0) if kind == "poisson" else 0.5
    before = 0.0  # expected arrivals before the current segment
    for s in trace:
        total = s.expected(s.seconds)
        while target <= before + total:
            out.append(s.start + s.at_count(target - before))
            target += rng.expovariate(1.0) if kind == "poisson" else 1.0
        before += total
    return out


def first_change(trace: list[Segment]) -> float:
    """When the rate first differs from the trace's starting rate."""
    for s in trace:
        if s.r0 != trace[0].r0 or s.r1 != trace[0].r0:
            return s.start
    return duration(trace)


def prompt(seed: int, i: int, isl: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + i)  # one RNG per request: the same prompt in every configuration
    return [rng.randrange(10, VOCAB - 8) for _ in range(isl)]


# --- one request -------------------------------------------------------------------------------------
@dataclass
class Req:
    i: int
    scheduled: float  # trace seconds
    sent: float = 0.0  # trace seconds
    status: int = 0
    ttft: float | None = None  # s from the send
    tokens: list[float] = field(default_factory=list)  # chunk times, s from the send
    generated: int = 0  # completion tokens (usage): a chunk may carry several (held-back UTF-8 pieces)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def itl(self) -> float | None:
        if len(self.tokens) < 2 or self.generated < 2:
            return None
        return (self.tokens[-1] - self.tokens[0]) / (self.generated - 1)


async def one(session: aiohttp.ClientSession, url: str, r: Req, body: bytes, osl: int, t0: float) -> None:
    start = time.monotonic()
    r.sent = start - t0
    try:
        async with session.post(url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:160]}"
                return
            sse = SseStream()
            async for event in sse.events(resp.content):
                if "error" in event:
                    r.error = str(event["error"].get("message", event["error"]))[:160]
                    continue
                if event.get("usage"):
                    r.generated = event["usage"].get("completion_tokens", 0)
                if event.get("choices"):
                    now = time.monotonic() - start
                    if r.ttft is None:
                        r.ttft = now
                    r.tokens.append(now)
            if r.error is None and (not sse.done or r.generated < osl):
                r.error = f"{r.generated} of {osl} tokens{'' if sse.done else ', no [DONE]'}"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"[:160]


# --- watching the deployment -------------------------------------------------------------------------
@dataclass
class Sample:
    t: float  # trace seconds
    replicas: dict[str, int]  # children not stopped, per pool
    running: dict[str, int]  # of which running
    gen_cpu: float  # this process
    root_cpu: float  # the root supervisor process (it hosts the frontend)
    rest_cpu: float  # the rest of the deployment's tree (workers, nats-server)
    busy: float  # the machine
    total: float


async def children(nc: Any, subjects: Subjects) -> list[dict[str, Any]]:
    msg = await nc.request(subjects.supervisor(HOST, "children"), b"{}", timeout=2.0)
    return json.loads(msg.data)["children"]


async def sample(nc: Any, subjects: Subjects, root: int, t: float, last: Sample | None) -> Sample:
    try:
        kids = await children(nc, subjects)
    except Exception:  # noqa: BLE001 - a missed poll keeps the last counts
        kids = None
    if kids is None and last is not None:
        replicas, running = dict(last.replicas), dict(last.running)
    else:
        replicas = {p: 0 for p in POOLS}
        running = {p: 0 for p in POOLS}
        for c in kids or []:
            pool = (c.get("meta") or {}).get("pool")
            if pool in replicas and c.get("state") != "stopped":
                replicas[pool] += 1
                running[pool] += c.get("state") == "running"
    below = tree(root)[1:]
    busy, total = machine_cpu()
    return Sample(t=t, replicas=replicas, running=running, gen_cpu=own_cpu(os.getpid()), root_cpu=own_cpu(root),
                  rest_cpu=sum(own_cpu(p) for p in below), busy=busy, total=total)


@dataclass
class Run:
    config: str
    requests: list[Req]
    samples: list[Sample]
    decisions: list[dict[str, Any]]  # as published, plus "t": trace seconds when received
    exit_code: int | None = None
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    ready_s: float = 0.0


async def replay(d: Deployment, config: str, a: argparse.Namespace, times: list[float]) -> Run:
    subjects = Subjects(d.namespace)
    nc = await nats.connect(d.bus_url, max_reconnect_attempts=5, connect_timeout=3)
    run = Run(config=config, requests=[Req(i, at) for i, at in enumerate(times)], samples=[], decisions=[])
    t0 = time.monotonic() + 2.0  # set below, after the warm-up

    async def on_decision(msg: Any) -> None:
        with contextlib.suppress(ValueError):
            run.decisions.append({"t": round(time.monotonic() - t0, 2), **json.loads(msg.data)})

    sub = await nc.subscribe(subjects.planner_decision(), cb=on_decision)
    assert d.proc is not None
    root = d.proc.pid
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=120)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            # warm the frontend's first-request paths, outside the trace; shaped like the trace's
            # requests, as the planner observes them too (a short one would drag its ISL/OSL forecasts)
            for k in range(2):
                w = Req(-1 - k, 0.0)
                await one(s, d.url, w, json.dumps({"model": MODEL, "prompt": prompt(a.seed + 1, k, a.isl),
                                                   "max_tokens": a.osl, **STREAM}).encode(), a.osl, time.monotonic())
            t0 = time.monotonic() + 1.0
            end = duration(parse_trace(a.trace))
            stop = asyncio.Event()

            async def sampler() -> None:
                last: Sample | None = None
                k = 0
                while not stop.is_set():
                    await asyncio.sleep(max(0.0, t0 + k - time.monotonic()))
                    last = await sample(nc, subjects, root, time.monotonic() - t0, last)
                    run.samples.append(last)
                    k += 1

            poll = asyncio.create_task(sampler())
            tasks = []
            for r in run.requests:
                await asyncio.sleep(max(0.0, t0 + r.scheduled - time.monotonic()))
                body = json.dumps({"model": MODEL, "prompt": prompt(a.seed, r.i, a.isl), "max_tokens": a.osl,
                                   **STREAM}).encode()
                tasks.append(asyncio.create_task(one(s, d.url, r, body, a.osl, t0)))
            await asyncio.sleep(max(0.0, t0 + end - time.monotonic()))
            await asyncio.gather(*tasks)
            await asyncio.sleep(max(0.0, t0 + math.ceil(time.monotonic() - t0) + 0.05 - time.monotonic()))
            stop.set()
            await poll
    finally:
        await sub.unsubscribe()
        await nc.close()
    return run


# --- deployments -------------------------------------------------------------------------------------
def topology_pools() -> dict[str, dict[str, Any]]:
    return tomllib.loads((ROOT / "topologies" / TOPOLOGY).read_text())["pools"]


def config_sets(config: str, a: argparse.Namespace, peak: dict[str, int] | None, profiles: Path | None) -> list[str]:
    sets = list(a.set)
    if config in PLANNER_CONFIGS:
        every = a.planner_interval if config == "load" else a.throughput_interval
        sets += ["planner.enabled=true", f"planner.mode={config}", f"planner.interval={every:g}"]
        if config == "throughput":
            assert profiles is not None
            sets.append(f"planner.profile_dir={profiles}")
    else:
        counts = peak if config == "static-peak" else {p: 1 for p in POOLS}
        assert counts is not None
        sets += ["planner.enabled=false"] + [f"pools.{p}.replicas={n}" for p, n in counts.items()]
    return sets


def run_config(config: str, a: argparse.Namespace, times: list[float], tmp: Path, peak: dict[str, int] | None,
               profiles: Path | None) -> Run:
    sets = config_sets(config, a, peak, profiles)
    work = tmp / config
    work.mkdir(parents=True, exist_ok=True)
    ns = "pb" + re.sub(r"[^a-z0-9]", "", config) + str(os.getpid())
    d = Deployment(TOPOLOGY, work, namespace=ns, sets=sets)
    counts = peak if config == "static-peak" else {p: 1 for p in POOLS}
    print(f"[{config}] python -m actors.supervisor topologies/{TOPOLOGY} "
          + " ".join(f"--set {x}" for x in sets), file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    t = time.monotonic()
    d.start()
    below: list[int] = []
    try:
        d.wait_ready(dict(counts or {}), timeout=180)
        ready = time.monotonic() - t
        assert d.proc is not None
        run = asyncio.run(replay(d, config, a, times))
        below = tree(d.proc.pid)[1:]
    finally:
        if not below and d.proc is not None:
            below = tree(d.proc.pid)[1:]
        rc = d.stop(90)
        time.sleep(0.5)
        kill_leftovers(below)  # workers and nats-server run in sessions of their own
    run.exit_code, run.ready_s = rc, round(ready, 1)
    run.load_before, run.load_after = tuple(round(x, 2) for x in load_before), tuple(
        round(x, 2) for x in os.getloadavg())
    if rc != 0:
        print(f"[{config}] supervisor exit code {rc}:\n{d.output(3000)}", file=sys.stderr)
    return run


def make_profiles(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Profile each pool with the deployment's own engine args (the bench's --sets) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"dir": str(out), "commands": [], "seconds": {}}
    for pool in POOLS:
        cmd = [sys.executable, "-m", "actors.planner.profile", f"topologies/{TOPOLOGY}", "--pool", pool,
               "--set", f"planner.profile_dir={out}", *[x for s in a.set for x in ("--set", s)],
               *shlex.split(a.profile_args), "--log-level", "WARNING"]
        shown = "python -m actors.planner.profile " + " ".join(shlex.quote(c) for c in cmd[3:])
        info["commands"].append(shown)
        print(f"[profile] {shown}", file=sys.stderr, flush=True)
        t = time.monotonic()
        with open(out / f"{pool}.log", "wb") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        info["seconds"][pool] = round(time.monotonic() - t, 1)
        if rc != 0:
            raise SystemExit(f"profiling {pool} failed ({rc}):\n{(out / f'{pool}.log').read_text()[-3000:]}")
    return info


# --- numbers -----------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def at_or_before(samples: list[Sample], t: float) -> Sample | None:
    i = bisect.bisect_right([s.t for s in samples], t)
    return samples[i - 1] if i else (samples[0] if samples else None)


def first_adjustment(run: Run) -> float | None:
    for d in run.decisions:
        if not d.get("no_op") and any(p["target"] != p["current"] for p in d.get("pools", [])):
            return d["t"]
    return None


def intervals(run: Run, a: argparse.Namespace, trace: list[Segment]) -> list[dict[str, Any]]:
    out = []
    n = math.ceil(duration(trace) / a.interval - 1e-9)
    for k in range(n):
        lo, hi = k * a.interval, min((k + 1) * a.interval, duration(trace))
        reqs = [r for r in run.requests if lo <= r.scheduled < hi]
        ok = [r for r in reqs if r.ok]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        itls = [x for x in (r.itl for r in ok) if x is not None]
        row: dict[str, Any] = {
            "t": lo, "rate": round((sum(s.expected(min(max(hi - s.start, 0), s.seconds))
                                        - s.expected(min(max(lo - s.start, 0), s.seconds)) for s in trace))
                                   / (hi - lo), 2),
            "requests": len(reqs), "failed": len(reqs) - len(ok),
            "ttft_mean_ms": ms(mean(ttfts)), "ttft_p90_ms": ms(pct(ttfts, 0.9)),
            "itl_mean_ms": ms(mean(itls)), "itl_p90_ms": ms(pct(itls, 0.9))}
        clean = bool(reqs) and not row["failed"] and ttfts and itls
        row["holds_mean"] = bool(clean and row["ttft_mean_ms"] <= a.ttft and row["itl_mean_ms"] <= a.itl)
        row["holds_p90"] = bool(clean and row["ttft_p90_ms"] <= a.ttft and row["itl_p90_ms"] <= a.itl)
        s_hi = at_or_before(run.samples, hi)
        row["replicas"] = dict(s_hi.replicas) if s_hi else {}
        win = [s for s in run.samples if lo - 1e-6 <= s.t <= hi + 1e-6]
        if len(win) >= 2:
            dt = win[-1].t - win[0].t
            row["cpu_pct"] = {"generator": round(100 * (win[-1].gen_cpu - win[0].gen_cpu) / dt),
                              "root": round(100 * (win[-1].root_cpu - win[0].root_cpu) / dt),
                              "workers_nats": round(100 * (win[-1].rest_cpu - win[0].rest_cpu) / dt),
                              "machine": round(100 * (win[-1].busy - win[0].busy)
                                               / max(1e-9, win[-1].total - win[0].total))}
        out.append(row)
    return out


def replica_seconds(run: Run, end: float) -> dict[str, float]:
    """Replicas per pool integrated over [0, end] (each 1-s sample holds until the next)."""
    out = {p: 0.0 for p in POOLS}
    ss = [s for s in run.samples if s.t < end]
    for i, s in enumerate(ss):
        nxt = ss[i + 1].t if i + 1 < len(ss) else end
        lo = max(0.0, s.t)
        if nxt > lo:
            for p in POOLS:
                out[p] += s.replicas.get(p, 0) * (nxt - lo)
    return {p: round(v, 1) for p, v in out.items()}


def summarize(run: Run, a: argparse.Namespace, trace: list[Segment]) -> dict[str, Any]:
    rows = intervals(run, a, trace)
    adj = first_adjustment(run) if run.config in PLANNER_CONFIGS else first_change(trace)
    after = [r for r in rows if adj is not None and r["t"] >= adj - 1e-9]
    ok = [r for r in run.requests if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for x in (r.itl for r in ok) if x is not None]
    rs = replica_seconds(run, duration(trace))
    lag = [r.sent - r.scheduled for r in run.requests]
    span = [s for s in run.samples if 0 <= s.t <= duration(trace)]
    cpu: dict[str, Any] = {}
    if len(span) >= 2:
        dt = span[-1].t - span[0].t
        cpu = {"generator_pct": round(100 * (span[-1].gen_cpu - span[0].gen_cpu) / dt),
               "root_pct": round(100 * (span[-1].root_cpu - span[0].root_cpu) / dt),
               "workers_nats_pct": round(100 * (span[-1].rest_cpu - span[0].rest_cpu) / dt),
               "machine_pct": round(100 * (span[-1].busy - span[0].busy) / max(1e-9, span[-1].total - span[0].total)),
               "generator_max_interval_pct": max((r["cpu_pct"]["generator"] for r in rows if "cpu_pct" in r), default=0),
               "root_max_interval_pct": max((r["cpu_pct"]["root"] for r in rows if "cpu_pct" in r), default=0)}
    errors: dict[str, int] = {}
    for r in run.requests:
        if r.error:
            key = re.sub(r"\d+", "N", r.error)[:80]
            errors[key] = errors.get(key, 0) + 1
    return {
        "config": run.config, "exit_code": run.exit_code, "ready_s": run.ready_s,
        "load_before": run.load_before, "load_after": run.load_after,
        "requests": len(run.requests), "failed": len(run.requests) - len(ok), "errors": errors,
        "first_adjustment_s": adj,
        "intervals_after": len(after),
        "holds_mean_after": sum(r["holds_mean"] for r in after), "holds_p90_after": sum(r["holds_p90"] for r in after),
        "share_mean_after": round(sum(r["holds_mean"] for r in after) / len(after), 3) if after else None,
        "share_p90_after": round(sum(r["holds_p90"] for r in after) / len(after), 3) if after else None,
        "share_mean_all": round(sum(r["holds_mean"] for r in rows) / len(rows), 3),
        "replica_seconds": rs, "replica_seconds_total": round(sum(rs.values()), 1),
        "max_replicas": {p: max((s.replicas.get(p, 0) for s in run.samples), default=0) for p in POOLS},
        "ttft_mean_ms": ms(mean(ttfts)), "ttft_p90_ms": ms(pct(ttfts, 0.9)),
        "itl_mean_ms": ms(mean(itls)), "itl_p90_ms": ms(pct(itls, 0.9)),
        "send_lag_max_ms": ms(max(lag, default=0.0)), "send_lag_p99_ms": ms(pct(lag, 0.99)),
        "cpu": cpu, "intervals": rows,
        "scale_changes": [{"t": d["t"], **{p["pool"]: f"{p['current']}->{p['target']}" for p in d["pools"]
                                           if p["target"] != p["current"]}}
                          for d in run.decisions if any(p["target"] != p["current"] for p in d.get("pools", []))],
        "decisions": run.decisions,
    }


# --- report ------------------------------------------------------------------------------------------
def fmt(x: Any, nd: int = 0) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return str(x)


def replicas_str(r: dict[str, int]) -> str:
    return "+".join(str(r.get(p, 0)) for p in POOLS)


def render(res: dict[str, Any], a: argparse.Namespace, command: str) -> str:
    trace = parse_trace(a.trace)
    configs = res["configs"]
    peak = configs.get("static-peak")
    lines = [
        "How the SLA planner trades engines for latency: one request-rate trace replayed against "
        f"`topologies/{TOPOLOGY}` (disaggregated mocker pools `prefill` + `decode`, kv router) with the "
        "planner in load and throughput mode, and with the planner disabled at the planner's peak "
        "(static-peak) and at one replica per pool (static-min).",
        "",
        f"Command: `{command}`",
        "",
        f"- Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), Python "
        f"{platform.python_version()}; load average (1 min) before each configuration: "
        + ", ".join(f"{c} {s['load_before'][0]}" for c, s in configs.items()) + ".",
        f"- Trace `{a.trace}` (RATE:SECONDS, R0-R1:SECONDS = linear ramp), {duration(trace):.0f} s, "
        f"{a.arrivals} arrivals (seed {a.seed}, the same {res['requests']} arrival times and prompts in every "
        f"configuration); each request a streamed `/v1/completions` of {a.isl} random token ids (no "
        f"shared prefix: no KV hits), `max_tokens` {a.osl}, `ignore_eos`.",
        f"- Targets: TTFT {a.ttft:g} ms, ITL {a.itl:g} ms; planner budget {res['budget']} engines; "
        f"`planner.interval` (`--set`) {a.planner_interval:g} s in load mode (its default), "
        f"{getattr(a, 'throughput_interval', a.planner_interval):g} s in throughput mode (its default of "
        f"180 s outlasts the trace's phases); bench intervals {a.interval:g} s.",
        "- Engine args (topology): " + "; ".join(
            f"{p}: " + ", ".join(f"{k}={v}" for k, v in res["engine_args"][p].items()) for p in POOLS)
        + (f"; extra `--set`: {', '.join(a.extra)}" if a.extra else "") + ".",
    ]
    if peak:
        lines.append(f"- static-peak ran at {replicas_str(peak['peak'])} (prefill+decode): "
                     + ("`--peak`." if a.peak else "per pool, the smaller of the planner runs' peaks."))
    lines.append(f"- Code: commit {res['commit']}" + (" with uncommitted changes in actors/planner" if res["dirty"] else "")
                 + ".")
    if res.get("profiles"):
        pr = res["profiles"]
        lines.append("- Throughput mode's profiles, made before its run ("
                     + ", ".join(f"{p} {s:.0f} s" for p, s in pr["seconds"].items()) + "): "
                     + "; ".join(f"`{c}`" for c in pr["commands"]) + ".")
    lines += [
        "- TTFT: send to first token; ITL: a request's (last - first token time) / (tokens - 1). A request "
        "counts for the interval of its scheduled arrival. An interval *holds* (mean) when mean TTFT and "
        "mean ITL are within target and no request failed; *p90*: the same with p90s.",
        "- After the first adjustment: intervals starting at or after the planner's first decision that "
        "changed a count; for static configurations, at or after the trace's first rate change "
        f"({first_change(trace):.0f} s). Replica-seconds: replicas per pool (the root's children, not "
        "stopped, polled every second) integrated over the trace.",
        "",
        "| configuration | replicas (max prefill+decode) | holds after 1st adjustment, mean | p90 | all intervals, mean "
        "| replica-s | vs static-peak | requests | failed | TTFT mean / p90 ms | ITL mean / p90 ms "
        "| CPU % generator / root / machine | send lag p99 / max ms | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, s in configs.items():
        ratio = (s["replica_seconds_total"] / peak["replica_seconds_total"]) if peak else None
        cpu = s["cpu"]
        lines.append(
            f"| {c} | {replicas_str(s['max_replicas'])} "
            f"| {s['holds_mean_after']}/{s['intervals_after']} ({fmt(100 * s['share_mean_after'] if s['share_mean_after'] is not None else None)} %) "
            f"| {s['holds_p90_after']}/{s['intervals_after']} "
            f"| {fmt(100 * s['share_mean_all'])} % "
            f"| {fmt(s['replica_seconds_total'])} | {fmt(ratio, 2)} | {s['requests']} | {s['failed']} "
            f"| {fmt(s['ttft_mean_ms'])} / {fmt(s['ttft_p90_ms'])} | {fmt(s['itl_mean_ms'], 1)} / {fmt(s['itl_p90_ms'], 1)} "
            f"| {cpu.get('generator_pct')} / {cpu.get('root_pct')} / {cpu.get('machine_pct')} "
            f"| {fmt(s['send_lag_p99_ms'])} / {fmt(s['send_lag_max_ms'])} | {s['exit_code']} |")
    lines.append("")
    lines += acceptance(configs)
    for c in PLANNER_CONFIGS:
        if c not in configs:
            continue
        s = configs[c]
        lines += ["", f"### {c} mode, per interval", "",
                  f"First adjustment at {fmt(s['first_adjustment_s'], 1)} s. Count changes (t: pool current->target): "
                  + ("; ".join(f"{x['t']:.0f} s " + ", ".join(f"{k} {v}" for k, v in x.items() if k != "t")
                               for x in s["scale_changes"]) or "none") + ".", "",
                  "| t s | rate | req | TTFT mean / p90 ms | ITL mean / p90 ms | holds mean / p90 | replicas p+d "
                  "| CPU % gen / root |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in s["intervals"]:
            cp = r.get("cpu_pct", {})
            lines.append(
                f"| {r['t']:.0f} | {r['rate']:g} | {r['requests']}{'' if not r['failed'] else ' (' + str(r['failed']) + ' failed)'} "
                f"| {fmt(r['ttft_mean_ms'])} / {fmt(r['ttft_p90_ms'])} | {fmt(r['itl_mean_ms'], 1)} / {fmt(r['itl_p90_ms'], 1)} "
                f"| {'yes' if r['holds_mean'] else 'NO'} / {'yes' if r['holds_p90'] else 'no'} "
                f"| {replicas_str(r['replicas'])} | {cp.get('generator', '–')} / {cp.get('root', '–')} |")
    return "\n".join(lines) + "\n"


def acceptance(configs: dict[str, Any]) -> list[str]:
    peak = configs.get("static-peak")
    out = ["Acceptance (issue 13):", ""]
    for c in PLANNER_CONFIGS:
        if c not in configs:
            continue
        s = configs[c]
        share = s["share_mean_after"]
        ratio = s["replica_seconds_total"] / peak["replica_seconds_total"] if peak else None
        out.append(f"- {c}: targets hold (mean) in {fmt(100 * share if share is not None else None)} % of intervals "
                   f"after the first adjustment ({'meets' if share is not None and share >= 0.9 else 'misses'} >= 90 %), "
                   f"at {fmt(ratio, 2)}x static-peak's replica-seconds "
                   f"({'meets' if ratio is not None and ratio <= 0.7 else 'misses'} <= 0.7x).")
    for c in ("static-peak", "static-min"):
        if c in configs:
            s = configs[c]
            out.append(f"- {c}: holds (mean) in {fmt(100 * s['share_mean_after'] if s['share_mean_after'] is not None else None)} % "
                       f"of intervals after the first rate change"
                       + (" (must miss: " + ("it does" if (s["share_mean_after"] or 0) < 0.9 else "it does NOT") + ")."
                          if c == "static-min" else "."))
    return out


# --- main --------------------------------------------------------------------------------------------
def parse_peak(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        pool, _, n = part.partition("=")
        if pool not in POOLS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--peak: {part!r} is not POOL=N with POOL in {POOLS}")
        out[pool] = int(n)
    return {p: out.get(p, 1) for p in POOLS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="load,throughput,static-peak,static-min")
    p.add_argument("--trace", default="1:60,1-10:60,10:90,10-1:60,1:90")
    p.add_argument("--arrivals", choices=["poisson", "even"], default="poisson")
    p.add_argument("--isl", type=int, default=1024)
    p.add_argument("--osl", type=int, default=150)
    p.add_argument("--ttft", type=float, default=500.0, help="TTFT target, ms (also set on the planner)")
    p.add_argument("--itl", type=float, default=50.0, help="ITL target, ms (also set on the planner)")
    p.add_argument("--interval", type=float, default=10.0, help="reporting interval, s")
    p.add_argument("--planner-interval", type=float, default=5.0, help="load mode's planner.interval, s")
    p.add_argument("--throughput-interval", type=float, default=10.0,
                   help="throughput mode's planner.interval, s (its default of 180 s outlasts the trace's phases)")
    p.add_argument("--peak", type=parse_peak,
                   help="static-peak's replicas, e.g. prefill=2,decode=4 (default: the planner runs' smaller peak per pool)")
    p.add_argument("--profiles", type=Path, help="reuse this profile dir (prefill.json, decode.json)")
    p.add_argument("--profile-args", default="", help="extra arguments for python -m actors.planner.profile")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra topology override for every configuration and the profiler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--write", type=Path, help="update the section of this markdown file")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="only re-render (--write) from a JSON this bench wrote with --out; no run")
    a = p.parse_args()
    if a.render:
        res = json.loads(a.render.read_text())
        saved = argparse.Namespace(**{**res["args"], "render": None, "write": a.write})
        body = render(res, saved, res.get("command", "(not recorded)"))
        print(body)
        if a.write:
            write_section(a.write, SECTION, body, READING)
        return 0
    a.extra = list(a.set)  # the user's own overrides (reported)
    a.set = [*a.set, f"planner.ttft_target_ms={a.ttft:g}", f"planner.itl_target_ms={a.itl:g}"]
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    for c in configs:
        if c not in (*PLANNER_CONFIGS, "static-peak", "static-min"):
            raise SystemExit(f"--configs: unknown {c!r}")
    if "static-peak" in configs and a.peak is None and not any(c in PLANNER_CONFIGS for c in configs):
        raise SystemExit("static-peak needs --peak or a planner configuration before it")
    configs.sort(key=lambda c: c == "static-peak")  # the planner runs decide static-peak's size
    trace = parse_trace(a.trace)
    times = arrivals(trace, a.arrivals, a.seed)
    pools = topology_pools()
    res: dict[str, Any] = {"requests": len(times), "configs": {}, "budget": 8,
                           "engine_args": {p: pools[p].get("engine_args", {}) for p in POOLS},
                           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}}
    res["budget"] = tomllib.loads((ROOT / "topologies" / TOPOLOGY).read_text())["planner"].get("budget", 8)
    res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True, check=False).stdout.strip()
    res["dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "actors/planner"], cwd=ROOT,
                                       capture_output=True, text=True, check=False).stdout.strip())
    print(f"trace {a.trace}: {len(times)} requests over {duration(trace):.0f} s", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="planner-bench-") as t:
        tmp = Path(t)
        profiles = a.profiles
        if "throughput" in configs and profiles is None:
            profiles = tmp / "profiles"
            res["profiles"] = make_profiles(a, profiles)
        for c in configs:
            peak = a.peak
            if c == "static-peak" and peak is None:
                # the leanest peak a planner run reached, per pool: sized for the peak, not for a
                # forecast's overshoot (static-peak's own intervals show whether it holds)
                peak = {pl: min(res["configs"][x]["max_replicas"][pl] for x in PLANNER_CONFIGS if x in res["configs"])
                        for pl in POOLS}
            run = run_config(c, a, times, tmp, peak, profiles)
            s = summarize(run, a, trace)
            if c == "static-peak":
                s["peak"] = peak
            res["configs"][c] = s
            print(json.dumps({k: v for k, v in s.items() if k not in ("intervals", "decisions")}), flush=True)
    res["configs"] = {c: res["configs"][c] for c in
                      sorted(res["configs"], key=lambda c: ["load", "throughput", "static-peak", "static-min"].index(c))}
    res["command"] = (".venv/bin/python bench/planner_bench.py "
                      + " ".join(shlex.quote(x) for x in sys.argv[1:])).strip()
    body = render(res, a, res["command"])
    print(body)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1, default=str))
    if a.write:
        write_section(a.write, SECTION, body, READING)
    return 0 if all(s["exit_code"] == 0 for s in res["configs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
