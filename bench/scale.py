"""Scale on one box: N mocker workers (one OS process each) behind one frontend and the kv router.

    .venv/bin/python bench/scale.py [--sizes 8,16,32,64] [--requests 1000] [--output-tokens 32]
        [--groups 50] [--seed 0] [--start-concurrency K] [--out FILE.json] [--write docs/benchmarks.md]
    .venv/bin/python bench/scale.py --render FILE.json --write docs/benchmarks.md

For each N a fresh deployment is started as a user starts one: ``python -m actors.supervisor
topologies/mocker-kv.toml --set pools.agg.replicas=N`` with its own namespace, HTTP port and run
dir, and ``bus.url`` pointing at a nats-server this bench starts for the size (JetStream on, plus a
monitoring port, so the server's own message and byte counters can be read from ``/varz``).

Per N:

- startup: seconds from the supervisor's start to ``/health`` 200 listing N instances; then the root
  supervisor's ``children`` view (worker restarts = failed starts) and the run dir's logs searched
  for ``Address already in use``;
- after a short warm-up, 5 s of idle bus traffic (``/varz``), then ``--requests`` streamed
  ``/v1/chat/completions`` sent at once (``max_tokens`` ``--output-tokens``, ``ignore_eos``): each
  prompt is one of ``--groups`` system prompts (a shared prefix the kv router can find) and a
  distinct user message. An error is a non-200, an error event, a stream that does not end with
  ``[DONE]``, fewer tokens than asked, or a client exception. TTFT: from the send to the first
  chunk after the role chunk;
- over that request phase: req/s (requests / phase wall time), the frontend's router histograms
  (``vllm_actors_router_hashing_seconds``, ``vllm_actors_router_matching_seconds``, ``vllm_actors_router_scheduling_seconds``: their
  delta over the phase; the decision's mean is exact from ``_sum``/``_count``, its p50/p99 the sum
  of the three stages' bucket-interpolated quantiles), the bus server's ``in_msgs``, ``out_msgs``,
  ``in_bytes``, ``out_bytes`` deltas per request, and CPU seconds of the root process (it hosts the
  frontend and the router), of the workers, of the nats-server and of this client;
- after the phase: the router's index (``<ns>.router.index.stats``: distinct blocks and
  (block, worker) pairs) and memory (RSS and PSS from ``/proc/<pid>/smaps_rollup``) of each worker
  process and of the root process.

The section's reading (which quantities grow how with N) is computed from the figures: a power-law
fit y ≈ c·N^b over the sizes run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import nats

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.deployment import Deployment  # noqa: E402
from bench.docs_section import write_section  # noqa: E402
from bench.proc_cpu import cmdline, machine_cpu, own_cpu, tree  # noqa: E402
from bench.proc_mem import rss_pss  # noqa: E402
from bench.scale_stats import Histogram, growth, parse_histograms, percentile  # noqa: E402
from bench.shared_prefix import WORDS  # noqa: E402
from bench.sse import SseStream  # noqa: E402
from bus.embedded import EmbeddedNats, free_port  # noqa: E402
from bus.subjects import Subjects  # noqa: E402

TOPOLOGY = "topologies/mocker-kv.toml"
SECTION = "Scale"
READING = "<!-- hand-written from here on: bench/scale.py --write keeps it -->"
HOST = "local"  # the root supervisor's host token in a single-host topology
MODEL = "tiny"
STAGES = ("vllm_actors_router_hashing_seconds", "vllm_actors_router_matching_seconds", "vllm_actors_router_scheduling_seconds")
VARZ = ("in_msgs", "out_msgs", "in_bytes", "out_bytes")
IDLE_S = 5.0
BUDGET_GIB = 24  # the memory budget for one box
GIB = 1 << 30
MIB = 1 << 20


# --- workload ------------------------------------------------------------------------------------
def conversations(n: int, groups: int, seed: int) -> list[list[dict[str, str]]]:
    """``n`` chat prompts: system prompt ``i % groups`` (about 120 words, shared by its group) and a
    distinct user message (request number + 24 random words)."""
    rng = random.Random(seed)
    systems = [f"You are assistant {g}. " + " ".join(rng.choice(WORDS) for _ in range(120)) for g in range(groups)]
    return [[{"role": "system", "content": systems[i % groups]},
             {"role": "user", "content": f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(24))}]
            for i in range(n)]


@dataclass
class Outcome:
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None


async def one(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], osl: int) -> Outcome:
    body = {"model": MODEL, "messages": messages, "max_tokens": osl, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = Outcome()
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:160]}"
                return out
            sse = SseStream()
            async for event in sse.events(r.content):
                if "error" in event:
                    out.error = str(event["error"])[:160]
                    continue
                if event.get("usage"):
                    out.tokens = event["usage"].get("completion_tokens", 0)
                choices = event.get("choices") or []
                if out.ttft is None and choices and "role" not in (choices[0].get("delta") or {}):
                    out.ttft = time.perf_counter() - t0
            if out.error is None and (not sse.done or out.tokens < osl):
                out.error = f"{out.tokens} of {osl} tokens{'' if sse.done else ', no [DONE]'}"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:160]
    return out


# --- what the deployment and its bus say ---------------------------------------------------------
async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as r:
        return await r.json(content_type=None)


async def get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as r:
        return await r.text()


async def bus_request(bus_url: str, subject: str, timeout: float = 10.0) -> Any:
    nc = await nats.connect(bus_url, max_reconnect_attempts=3, connect_timeout=3)
    try:
        msg = await nc.request(subject, b"{}", timeout=timeout)
        return json.loads(msg.data)
    finally:
        await nc.close()


def count_in_logs(run_dir: pathlib.Path, needle: bytes) -> int:
    """Occurrences of ``needle`` in the run dir's log files (the supervisor's output included)."""
    hits = 0
    for p in run_dir.rglob("*"):
        if p.is_file() and (p.suffix in (".log", ".out", ".err") or p.name.endswith("log")):
            try:
                hits += p.read_bytes().count(needle)
            except OSError:
                pass
    return hits


def processes(root: int) -> dict[str, list[int]]:
    """The deployment's processes by kind: the root (frontend, router, supervisor), workers, others."""
    kinds: dict[str, list[int]] = {"root": [root], "workers": [], "other": []}
    for pid in tree(root)[1:]:
        kinds["workers" if "actors.worker" in cmdline(pid) else "other"].append(pid)
    return kinds


def memory(pids: list[int]) -> dict[str, float | None]:
    vals = [m for m in (rss_pss(p) for p in pids) if m is not None]
    if not vals:
        return {"n": 0, "rss_mib": None, "pss_mib": None, "rss_total_mib": None, "pss_total_mib": None}
    rss = sum(r for r, _ in vals)
    pss = sum(p for _, p in vals)
    return {"n": len(vals), "rss_mib": rss / len(vals) / MIB, "pss_mib": pss / len(vals) / MIB,
            "rss_max_mib": max(r for r, _ in vals) / MIB,
            "rss_total_mib": rss / MIB, "pss_total_mib": pss / MIB}


# --- one size ------------------------------------------------------------------------------------
async def measure(dep: Deployment, bus: EmbeddedNats, monitor: str, n: int, a: argparse.Namespace,
                  prompts: list[list[dict[str, str]]], t_start: float) -> dict[str, Any]:
    subjects = Subjects(dep.ns)
    bus_url = bus.url
    assert bus.pid is not None
    res: dict[str, Any] = {"n": n}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        await dep.wait_ready(s, n, a.ready_timeout, poll=0.25)
        res["ready_s"] = round(time.monotonic() - t_start, 2)  # from the supervisor's start
        kids = (await bus_request(bus_url, subjects.supervisor(HOST, "children")))["children"]
        workers = [c for c in kids if c["id"].startswith("worker-")]
        res["start"] = {"worker_children": len(workers), "running": sum(c["state"] == "running" for c in workers),
                        "restarts": sum(c["restarts"] for c in workers),
                        "address_in_use": count_in_logs(pathlib.Path(dep.run_dir), b"Address already in use")}
        # warm-up: the frontend's first tokenization and template paths, outside the measured phase
        for k in range(4):
            w = await one(s, dep.url, [{"role": "user", "content": f"warm up {k}"}], 2)
            if w.error:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        await asyncio.sleep(1.0)
        assert dep.proc is not None
        procs = processes(dep.proc.pid)
        cpu_pids = {"root": procs["root"], "workers": procs["workers"], "nats": [bus.pid],
                    "client": [os.getpid()]}

        def cpu() -> dict[str, float]:
            return {k: sum(own_cpu(p) for p in ps) for k, ps in cpu_pids.items()}

        # idle: what N workers cost with no request (heartbeats, load reports, registry)
        v0 = await get_json(s, monitor + "/varz")
        i0 = cpu()
        await asyncio.sleep(IDLE_S)
        i1 = cpu()
        v1 = await get_json(s, monitor + "/varz")
        res["bus_idle_per_s"] = {k: (v1[k] - v0[k]) / IDLE_S for k in VARZ}
        res["cpu_idle_pct"] = {k: 100 * (i1[k] - i0[k]) / IDLE_S for k in i0}

        h0 = parse_histograms(await get_text(s, dep.url + "/metrics"))
        c0 = cpu()
        b0 = await get_json(s, monitor + "/varz")
        m0 = machine_cpu()
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(s, dep.url, p, a.output_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        m1 = machine_cpu()
        b1 = await get_json(s, monitor + "/varz")
        c1 = cpu()
        h1 = parse_histograms(await get_text(s, dep.url + "/metrics"))

    errors = [o.error for o in outs if o.error]
    ttfts = [o.ttft for o in outs if o.ttft is not None and not o.error]
    res.update({
        "requests": len(outs), "errors": len(errors), "error_samples": sorted(set(errors))[:5],
        "wall_s": round(wall, 2), "req_per_s": len(outs) / wall,
        "ttft_p50_ms": 1e3 * (percentile(ttfts, 0.5) or float("nan")),
        "ttft_p99_ms": 1e3 * (percentile(ttfts, 0.99) or float("nan")),
        "bus_per_request": {k: (b1[k] - b0[k]) / len(outs) for k in VARZ},
        "cpu_s": {k: c1[k] - c0[k] for k in c0},
        # the whole machine (the lead's jobs included): busy share of all cores over the phase
        "machine_busy_pct": 100 * (m1[0] - m0[0]) / max(1e-9, m1[1] - m0[1]),
        # of which not this deployment, its bus or this client: other jobs on the shared machine
        "others_pct": 100 * ((m1[0] - m0[0]) - sum(c1[k] - c0[k] for k in c0)) / max(1e-9, m1[1] - m0[1]),
        "router": router_times(h0, h1),
    })
    stats = await bus_request(bus_url, subjects.router("index.stats"))
    index = stats.get("index", {})
    res["index"] = {"blocks": index.get("blocks"),
                    "pairs": sum(w.get("blocks", 0) for w in index.get("workers", {}).values()),
                    "workers": len(index.get("workers", {})), "events_applied": index.get("events_applied"),
                    "gaps": index.get("gaps"), "predicted_blocks": (stats.get("predicted") or {}).get("blocks")}
    res["memory"] = {"worker": memory(procs["workers"]), "root": memory(procs["root"]),
                     "other": memory(procs["other"]), "nats": memory([bus.pid])}
    return res


def router_times(before: dict[str, Histogram], after: dict[str, Histogram]) -> dict[str, Any]:
    """Per stage and for the whole decision: count, mean, p50, p99 (ms) over the window."""
    out: dict[str, Any] = {}
    total_sum, count = 0.0, 0.0
    p50 = p99 = 0.0
    for name in STAGES:
        if name not in after:
            return {"missing": name}
        h = after[name].minus(before[name]) if name in before else after[name]
        q50, q99 = h.quantile(0.5), h.quantile(0.99)
        out[name.removeprefix("router_").removesuffix("_seconds")] = {
            "count": h.count, "mean_ms": 1e3 * (h.mean or 0.0), "p50_ms": 1e3 * (q50 or 0.0), "p99_ms": 1e3 * (q99 or 0.0)}
        total_sum += h.sum
        count = h.count
        p50 += q50 or 0.0
        p99 += q99 or 0.0
    out["decision"] = {"count": count, "mean_ms": 1e3 * total_sum / count if count else None,
                       "p50_ms": 1e3 * p50, "p99_ms": 1e3 * p99}
    return out


def run_size(n: int, a: argparse.Namespace, prompts: list[list[dict[str, str]]]) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix=f"scale-nats-{n}-")
    mport = free_port()
    bus = EmbeddedNats(port=free_port(), store_dir=store, extra_args=["-m", str(mport)])
    bus.start_sync()
    dep = Deployment(TOPOLOGY, "kv", f"sc{os.getpid()}n{n}")
    dep.cmd += ["--set", f"pools.agg.replicas={n}", "--set", f"bus.url={bus.url}"]
    if a.start_concurrency:
        dep.cmd += ["--set", f"supervisor.start_concurrency={a.start_concurrency}"]
    print(f"[N={n}] python -m actors.supervisor {shlex.join(dep.cmd[3:])}", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    ok = False
    try:
        t = time.monotonic()
        dep.start()
        res = asyncio.run(measure(dep, bus, f"http://127.0.0.1:{mport}", n, a, prompts, t))
        res["load_before"] = round(load, 2)
        ok = res["errors"] == 0
        return res
    finally:
        dep.stop()
        bus.stop_sync()
        if ok:  # keep the run dir (logs) only when something went wrong
            shutil.rmtree(dep.run_dir, ignore_errors=True)
        else:
            print(f"[N={n}] logs kept in {dep.run_dir}", file=sys.stderr)
        shutil.rmtree(store, ignore_errors=True)


# --- report --------------------------------------------------------------------------------------
def fmt(x: Any, nd: int = 0) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "–"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _pair(x: float, y: float, nd: int = 1) -> str:
    return f"{fmt(x, nd)} / {fmt(y, nd)}"


def _pair_row(label: str, section: str, first: str, second: str, *, nd: int = 1, scale: float = 1.0,
              fit: str | None = None, sub: str | None = None) -> Row:
    """A row showing ``r[section][(sub)][first] / ...[second]`` (each divided by ``scale``), fitted on
    ``fit`` (one of the two keys) or not fitted."""
    def part(r: dict[str, Any]) -> dict[str, Any]:
        return r[section][sub] if sub else r[section]

    return (label, lambda r: _pair(part(r)[first] / scale, part(r)[second] / scale, nd), 0,
            (lambda r: part(r)[fit]) if fit else None)


# (label, the value shown, decimals, the value fitted for the growth reading or None)
Row = tuple[str, Callable[[dict[str, Any]], Any], int, Callable[[dict[str, Any]], float | None] | None]
ROWS: list[Row] = [
    ("startup to ready, s", lambda r: r["ready_s"], 1, lambda r: r["ready_s"]),
    ("worker restarts during start / `Address already in use` in logs",
     lambda r: _pair(r["start"]["restarts"], r["start"]["address_in_use"]), 0, None),
    ("errors / requests", lambda r: _pair(r["errors"], r["requests"]), 0, None),
    ("req/s", lambda r: r["req_per_s"], 1, lambda r: r["req_per_s"]),
    ("TTFT p50, ms", lambda r: r["ttft_p50_ms"], 0, lambda r: r["ttft_p50_ms"]),
    ("TTFT p99, ms", lambda r: r["ttft_p99_ms"], 0, lambda r: r["ttft_p99_ms"]),
    ("router decision mean, ms (exact)", lambda r: r["router"]["decision"]["mean_ms"], 3,
     lambda r: r["router"]["decision"]["mean_ms"]),
    _pair_row("router decision p50 / p99, ms (buckets)", "router", "p50_ms", "p99_ms", sub="decision", nd=3,
              fit="p99_ms"),
    _pair_row("  of which scheduling mean / p99, ms", "router", "mean_ms", "p99_ms", sub="scheduling", nd=3,
              fit="mean_ms"),
    ("index: distinct blocks", lambda r: r["index"]["blocks"], 0, lambda r: r["index"]["blocks"]),
    ("index: (block, worker) pairs", lambda r: r["index"]["pairs"], 0, lambda r: r["index"]["pairs"]),
    _pair_row("bus msgs in / out per request", "bus_per_request", "in_msgs", "out_msgs", fit="out_msgs"),
    _pair_row("bus KiB in / out per request", "bus_per_request", "in_bytes", "out_bytes", scale=1024,
              fit="out_bytes"),
    _pair_row("bus msgs in / out per s, idle", "bus_idle_per_s", "in_msgs", "out_msgs", nd=0, fit="out_msgs"),
    _pair_row("worker RSS / PSS, MiB each (mean)", "memory", "rss_mib", "pss_mib", sub="worker", nd=0,
              fit="pss_mib"),
    _pair_row("workers' RSS / PSS, MiB total", "memory", "rss_total_mib", "pss_total_mib", sub="worker", nd=0,
              fit="pss_total_mib"),
    _pair_row("root (frontend + router) RSS / PSS, MiB", "memory", "rss_mib", "pss_mib", sub="root", nd=0,
              fit="pss_mib"),
    ("root (frontend) CPU ms per request", lambda r: 1e3 * r["cpu_s"]["root"] / r["requests"], 2,
     lambda r: r["cpu_s"]["root"] / r["requests"]),
    ("root (frontend) CPU, % of one core over the phase", lambda r: 100 * r["cpu_s"]["root"] / r["wall_s"], 0,
     lambda r: r["cpu_s"]["root"] / r["wall_s"]),
    ("workers' CPU s, request phase", lambda r: r["cpu_s"]["workers"], 1, lambda r: r["cpu_s"]["workers"]),
    _pair_row("workers' / root CPU % of one core, idle", "cpu_idle_pct", "workers", "root", fit="workers"),
    ("machine CPU busy over the phase / of which other jobs, % of all cores",
     lambda r: _pair(r["machine_busy_pct"], r.get("others_pct"), 0), 0, None),
    ("nats-server / client CPU s, request phase", lambda r: _pair(r["cpu_s"]["nats"], r["cpu_s"]["client"]), 0,
     None),
]


def _fits(sizes: dict[str, dict[str, Any]], ns: list[str]) -> dict[str, Any]:
    """label -> Growth (or None) of every fitted row."""
    return {label: growth([int(n) for n in ns], [fit(sizes[n]) for n in ns])
            for label, _, _, fit in ROWS if fit is not None}


def table(sizes: dict[str, dict[str, Any]]) -> list[str]:
    ns = sorted(sizes, key=int)
    fits = _fits(sizes, ns)
    lines = ["| N workers | " + " | ".join(ns) + " | growth N^b: b (shape) |",
             "|---|" + "---|" * len(ns) + "---|"]
    for label, show, nd, _ in ROWS:
        g = fits.get(label)
        cell = f"{g.exponent:.2f} ({g.shape})" if g else ""
        lines.append(f"| {label} | " + " | ".join(fmt(show(sizes[n]), nd) for n in ns) + f" | {cell} |")
    return lines


def reading(sizes: dict[str, dict[str, Any]]) -> list[str]:
    ns = sorted(sizes, key=int)
    shapes: dict[str, list[str]] = {}
    for label, g in _fits(sizes, ns).items():
        if g:
            shapes.setdefault(g.shape, []).append(f"{label.strip()} (b = {g.exponent:.2f}, ×{g.ratio:.2f} "
                                                  f"for ×{g.n_ratio:.0f} workers)")
    out = [f"Growth over N = {', '.join(ns)} (least-squares fit of log y on log N; linear: 0.8 ≤ b ≤ 1.2, "
           "flat: |b| < 0.2):", ""]
    for shape in ("linear", "superlinear", "sublinear", "flat", "falls"):
        if shape in shapes:
            out.append(f"- {shape}: " + "; ".join(shapes[shape]) + ".")
    big = sizes[ns[-1]]
    w = big["memory"]["worker"]
    if w["rss_mib"]:
        n = int(ns[-1])
        root = big["memory"]["root"]["rss_mib"] or 0.0
        rss64 = (64 * w["rss_mib"] + root) / 1024
        pss64 = (64 * w["pss_mib"] + root) / 1024
        out += ["", f"Memory at 64 workers, one OS process each, from the N = {n} run's per-worker figures: "
                f"64 × {w['rss_mib']:.0f} MiB RSS + root {root:.0f} MiB = {rss64:.1f} GiB by RSS (shared pages "
                f"counted in every process), {pss64:.1f} GiB by PSS, against the {BUDGET_GIB} GiB budget: "
                + ("it fits, so workers stay one per OS process." if rss64 <= BUDGET_GIB else
                   "it does NOT fit by RSS." if pss64 > BUDGET_GIB else
                   "it fits by PSS (the memory really used), not by RSS.")]
    starts = [f"N={n}: {sizes[n]['start']['restarts']} restarts, {sizes[n]['start']['address_in_use']} "
              "`Address already in use`" for n in ns]
    out += ["", "Worker starts: " + "; ".join(starts) + "."]
    errs = {n: sizes[n]["error_samples"] for n in ns if sizes[n]["errors"]}
    if errs:
        out += ["", f"Failed requests (samples): {errs}"]
    return out


def render(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = [
        "N mocker workers (one OS process each) behind one frontend with the kv router, started with the CLI "
        f"(`python -m actors.supervisor {TOPOLOGY} --set pools.agg.replicas=N`, private namespace, HTTP port and "
        "run dir, `bus.url` = a nats-server the bench starts per N with a monitoring port), then "
        f"{a['requests']:,} streamed `/v1/chat/completions` sent at once, {a['output_tokens']} output tokens each "
        f"(`ignore_eos`), prompts = one of {a['groups']} shared system prompts (~120 words) + a distinct user "
        "message.",
        "",
        f"Command: `{res['command']}`",
        "",
        f"- Machine: {res['machine']}; load average (1 min) before each N: "
        + ", ".join(f"{n}: {r['load_before']}" for n, r in sorted(res["sizes"].items(), key=lambda x: int(x[0])))
        + f". Code: commit {res['commit']}.",
        "- TTFT: client side, send to the first content chunk. Router decision: the frontend's "
        "`router_{hashing,matching,scheduling}_seconds` histograms, delta over the request phase; the mean is "
        "exact (`_sum`/`_count`), p50/p99 are the sum of the three stages' quantiles interpolated inside their "
        "buckets (bounds 1, 5, 10, 25, 50, 100, 250, 500 µs, 1, 2.5, 10, 100 ms), an estimate.",
        "- Bus: the nats-server's `/varz` counters over the request phase divided by the requests (all traffic: "
        f"requests, token streams, KV events, load reports, heartbeats); idle: the same over {IDLE_S:.0f} s before "
        "it. `in` = messages published to the server, `out` = messages it delivered.",
        "- Memory after the request phase, from `/proc/<pid>/smaps_rollup`: RSS counts shared pages (interpreter, "
        "libraries) in every process, PSS splits them among their sharers. Root = the supervisor process, which "
        "hosts the frontend, the router and the supervisor; its CPU is the frontend's.",
        "",
        *table(res["sizes"]),
        "",
        *reading(res["sizes"]),
    ]
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,16,32,64", help="worker counts, comma-separated")
    p.add_argument("--requests", type=int, default=1000, help="streams sent at once per size")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--groups", type=int, default=50, help="distinct system prompts (shared prefixes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-concurrency", type=int, help="supervisor.start_concurrency (default: the topology's)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    p.add_argument("--write", type=pathlib.Path, help="update the section of this markdown file")
    p.add_argument("--render", type=pathlib.Path, metavar="JSON",
                   help="only re-render (--write) from a JSON this bench wrote with --out; no run")
    a = p.parse_args()
    if a.render:
        res = json.loads(a.render.read_text())
    else:
        sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
        prompts = conversations(a.requests, a.groups, a.seed)
        res = {"command": (".venv/bin/python bench/scale.py " + shlex.join(sys.argv[1:])).strip(),
               "args": {k: v for k, v in vars(a).items() if k in ("sizes", "requests", "output_tokens", "groups",
                                                                  "seed", "start_concurrency")},
               "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs), "
                          f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GIB:.0f} GiB, "
                          f"Python {platform.python_version()}",
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, check=False).stdout.strip(),
               "sizes": {}}
        for n in sizes:
            r = run_size(n, a, prompts)
            res["sizes"][str(n)] = r
            print(json.dumps(r), flush=True)
            if a.out:  # after every size: a later failure keeps what was measured
                a.out.write_text(json.dumps(res, indent=1))
    body = render(res)
    print(body)
    if a.write:
        write_section(a.write, SECTION, body, READING)
    return 0 if all(r["errors"] == 0 for r in res["sizes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
