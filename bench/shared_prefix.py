"""Shared-prefix workload on topologies/mocker-kv.toml: round_robin vs kv routing vs an oracle.

    .venv/bin/python bench/shared_prefix.py [--groups 64] [--per-group 16] [--prefix-tokens 2048]
        [--question-tokens 128] [--output-tokens 64] [--concurrency 32] [--seed 0]
        [--modes round_robin,kv] [--write docs/benchmarks.md] [--json FILE]

For each router mode a fresh deployment (``python -m actors.supervisor topologies/mocker-kv.toml``,
own NATS port, namespace and run dir) serves the same request sequence: ``groups`` distinct system
prompts of ``prefix-tokens`` tokens, each followed by ``per-group`` distinct questions of
``question-tokens`` tokens, shuffled with ``seed`` so a group's requests are spread over the run.
Prompts are built from words with the tiny model's tokenizer and sent as token ids to
``/v1/completions`` (streaming, ``ignore_eos``), so the tokens the router hashes, the engines cache and
the oracle simulates are exactly the same. Reported: TTFT p50/p99, ITL p50, request and output-token
throughput, and the prefix hit rate sum(cached_tokens)/sum(prompt_tokens) from the engines' usage.
A mode ``kv@S`` runs the kv router with ``frontend.prefill_load_scale=S`` (how much one prefill block
weighs against one active decode block in the router's cost).

The oracle replays the sequence against 4 simulated LRU caches of the engines' capacity
(bench/prefix_sim.py), sending each request to the worker with the longest cached prefix. The real
runs' worker choices are replayed through the same simulation as a check of the simulation itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import re
import shutil
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.kv.hashing import sequence_hashes  # noqa: E402
from bench.deployment import Deployment  # noqa: E402
from bench.docs_section import write_section  # noqa: E402
from bench.prefix_sim import fixed_chooser, oracle_chooser, replay  # noqa: E402
from bench.sse import SseStream, TokenClock  # noqa: E402

TOPOLOGY = "topologies/mocker-kv.toml"
SECTION = "KV routing: shared-prefix workload"
READING = "<!-- hand-written from here on: bench/shared_prefix.py --write keeps it -->"
WORDS = ("the system answers questions about orders shipping returns billing accounts passwords "
         "devices network storage backup restore latency memory cluster region zone policy invoice "
         "customer support ticket priority escalation refund warranty serial firmware update driver "
         "printer laptop phone tablet router modem cable battery screen keyboard mouse camera audio "
         "video license subscription renewal discount coupon delivery tracking warehouse inventory "
         "supplier contract compliance audit report dashboard metric alert incident outage status").split()


# --- workload --------------------------------------------------------------------------------------
def tokenizer():
    from tokenizers import Tokenizer

    from actors.models.tiny import ensure_tiny_model

    return Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))


def text_tokens(tok, rng: random.Random, head: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of word text starting with ``head`` (words added until long enough)."""
    words = [head]
    ids: list[int] = []
    while len(ids) < n:
        words.extend(rng.choice(WORDS) for _ in range(max(16, (n - len(ids)) // 2)))
        ids = tok.encode(" ".join(words), add_special_tokens=False).ids
    return ids[:n]


@dataclass
class Workload:
    prompts: list[list[int]]  # in send order
    groups: list[int]


def build_workload(a: argparse.Namespace) -> Workload:
    tok = tokenizer()
    rng = random.Random(a.seed)
    prefixes = [text_tokens(tok, rng, f"System prompt {g}: you are assistant number {g}.", a.prefix_tokens)
                for g in range(a.groups)]
    order = [(g, q) for g in range(a.groups) for q in range(a.per_group)]
    rng.shuffle(order)
    prompts = [prefixes[g] + text_tokens(tok, rng, f"Question {q} of group {g}:", a.question_tokens)
               for g, q in order]
    return Workload(prompts=prompts, groups=[g for g, _ in order])


# --- client ----------------------------------------------------------------------------------------
@dataclass
class Result:
    ttft: float
    itls: list[float]
    end: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    worker: str


@dataclass
class Run:
    results: list[Result | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Result:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "skip_special_tokens": False, "stream": True, "stream_options": {"include_usage": True}}
    clock = TokenClock()
    usage: dict = {}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        worker = r.headers.get("x-worker-instance-id", "")
        async for msg in SseStream().events(r.content):
            if "error" in msg:
                raise RuntimeError(str(msg["error"])[:200])
            if msg.get("usage"):
                usage = msg["usage"]
            if msg.get("choices"):  # a token chunk (its text may be empty: partial UTF-8)
                clock.tick()
    details = usage.get("prompt_tokens_details") or {}
    return Result(ttft=clock.ttft, itls=clock.itls, end=time.perf_counter(),
                  prompt_tokens=usage.get("prompt_tokens", 0), cached_tokens=details.get("cached_tokens") or 0,
                  completion_tokens=usage.get("completion_tokens", 0), worker=worker)


async def fan_out(run: Any, n: int, concurrency: int,
                  call: Callable[[aiohttp.ClientSession, int], Awaitable[Any]]) -> Any:
    """Requests 0..n-1 in order from ``concurrency`` clients: ``run.results[i] = await call(http, i)``,
    a failure appended to ``run.errors`` (counted and reported, never silently dropped), ``run.wall``
    the seconds it all took. ``run``: any object with those three fields (the benches' ``Run``)."""
    queue = list(range(n))[::-1]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def client() -> None:
            while queue:
                i = queue.pop()
                try:
                    run.results[i] = await call(http, i)
                except Exception as e:
                    run.errors.append(f"request {i}: {e!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        run.wall = time.perf_counter() - t0
    return run


async def drive(url: str, w: Workload, a: argparse.Namespace) -> Run:
    return await fan_out(Run(results=[None] * len(w.prompts)), len(w.prompts), a.concurrency,
                         lambda http, i: one(http, url, w.prompts[i], a.output_tokens))


async def scrape_router_hit_rate(url: str) -> float | None:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        m = re.search(r"^vllm_actors_router_prefix_hit_rate (\S+)$", await r.text(), re.M)
    return float(m.group(1)) if m else None


async def run_mode(mode: str, w: Workload, a: argparse.Namespace, tag: str) -> dict:
    dep = Deployment(TOPOLOGY, mode, tag)
    dep.start()
    try:
        async with aiohttp.ClientSession() as s:
            await dep.wait_ready(s, a.workers, timeout=120)
            # warm the frontend's tokenizer/preprocessor load with prompts shorter than one block
            # (nothing cached, nothing in the oracle's way)
            for k in range(a.workers):
                await one(s, dep.url, [7 + k] * 8, 1)
        await asyncio.sleep(1.0)  # let the kv policy follow every worker's event stream
        run = await drive(dep.url, w, a)
        predicted = await scrape_router_hit_rate(dep.url) if mode.startswith("kv") else None
    finally:
        dep.stop()
    if not run.errors:  # keep the supervisor log and run dir only when something went wrong
        shutil.rmtree(dep.run_dir, ignore_errors=True)
    return summarize(mode, run, predicted)


# --- numbers ---------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)  # drop NaN (a request that produced no token chunk)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(mode: str, run: Run, predicted: float | None) -> dict:
    ok = [r for r in run.results if r is not None]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    workers = sorted({r.worker for r in ok})
    per_worker = {wk: sum(1 for r in ok if r.worker == wk) for wk in workers}
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "mode": mode, "requests": len(ok), "errors": len(run.errors), "error_samples": run.errors[:3],
        "wall_s": run.wall, "ttft_p50_ms": 1e3 * pct(ttfts, 0.5), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
        "itl_p50_ms": 1e3 * pct(itls, 0.5),
        # TTFT of requests that found any prefix cached vs none: separates the cache effect from queueing
        "ttft_hit_p50_ms": 1e3 * pct([r.ttft for r in ok if r.cached_tokens], 0.5),
        "ttft_miss_p50_ms": 1e3 * pct([r.ttft for r in ok if not r.cached_tokens], 0.5), "req_per_s": len(ok) / run.wall,
        "out_tok_per_s": sum(r.completion_tokens for r in ok) / run.wall,
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan"),
        "router_predicted_hit_rate": predicted, "requests_per_worker": sorted(per_worker.values()),
        "assignment": [r.worker if r is not None else "" for r in run.results],
    }


def simulate(w: Workload, a: argparse.Namespace, choose) -> float:
    hashes = [sequence_hashes(p, a.block_size) for p in w.prompts]
    total_blocks = (a.prefix_tokens + a.question_tokens + a.output_tokens - 1) // a.block_size
    tail = total_blocks - len(hashes[0])
    out = replay(hashes, a.workers, a.num_gpu_blocks, tail, choose)
    hit_tokens = sum(out["hit_blocks"]) * a.block_size
    return hit_tokens / sum(len(p) for p in w.prompts)


def replayed_hit_rate(w: Workload, a: argparse.Namespace, assignment: list[str]) -> float | None:
    if not all(assignment):
        return None
    index = {wk: i for i, wk in enumerate(sorted(set(assignment)))}
    if len(index) > a.workers:
        return None
    return simulate(w, a, fixed_chooser([index[wk] for wk in assignment]))


def render(a: argparse.Namespace, res: dict[str, dict], oracle: float, cmd: str) -> str:
    n = a.groups * a.per_group
    lines = [
        f"Command: `{cmd}`",
        "",
        f"Workload: {a.groups} groups × {a.per_group} prompts = {n} requests; each prompt = a "
        f"{a.prefix_tokens}-token system prompt (distinct per group) + a {a.question_tokens}-token "
        f"question (distinct per request), {a.output_tokens} output tokens (`ignore_eos`), streamed "
        f"`/v1/completions` with token-id prompts (built from words with the tiny model's tokenizer), "
        f"order shuffled with seed {a.seed} so each group is spread over the run; {a.concurrency} "
        f"requests in flight. Topology `{TOPOLOGY}`: {a.workers} mocker workers, {a.num_gpu_blocks} "
        f"blocks × {a.block_size} = {a.num_gpu_blocks * a.block_size // 1024} Ki tokens of KV each; the "
        f"{a.groups} prefixes take {a.groups * a.prefix_tokens // 1024} Ki tokens. A fresh deployment "
        f"per mode.",
        "",
        f"Machine: {os.uname().machine}, Python {sys.version.split()[0]}, 2 cores shared with other jobs "
        "(frontend, router, NATS and the 4 mocker processes all on them; the mocker's simulated time runs "
        "at speedup_ratio 1.0, so CPU contention adds to it — treat as ±20 %).",
        "",
        "| router | TTFT p50 | TTFT p99 | TTFT p50 hit / miss | ITL p50 | req/s | output tok/s | "
        "prefix hit rate | sim. hit rate of its choices | requests per worker |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in res.items():
        sim = r.get("replayed_hit_rate")
        lines.append(
            f"| {mode} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
            f"{r['ttft_hit_p50_ms']:.0f} / {r['ttft_miss_p50_ms']:.0f} ms | {r['itl_p50_ms']:.1f} ms | "
            f"{r['req_per_s']:.1f} | {r['out_tok_per_s']:.0f} | **{100 * r['hit_rate']:.1f} %** | "
            f"{'' if sim is None else f'{100 * sim:.1f} %'} | {r['requests_per_worker']} |")
    lines.append(f"| oracle (simulated) | | | | | | | **{100 * oracle:.1f} %** | | |")
    errs = {m: r["errors"] for m, r in res.items() if r["errors"]}
    if errs:
        lines += ["", f"Failed requests: {errs} (samples: "
                  f"{ {m: res[m]['error_samples'] for m in errs} })"]
    preds = [f"{m}: {100 * r['router_predicted_hit_rate']:.1f} %" for m, r in res.items()
             if r.get("router_predicted_hit_rate") is not None]
    if preds:
        lines += ["", "The kv router's own prediction (overlap blocks of the chosen worker in its index, "
                      f"`vllm_actors_router_prefix_hit_rate`, full prompt blocks): {', '.join(preds)}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="round_robin,kv")
    p.add_argument("--write", type=pathlib.Path, help="update the section of this markdown file")
    p.add_argument("--json", type=pathlib.Path, help="write the raw results here")
    a = p.parse_args()
    topo = tomllib.loads((ROOT / TOPOLOGY).read_text())
    pool = next(iter(topo["pools"].values()))
    a.workers, a.block_size = pool["replicas"], pool["engine_args"]["block_size"]
    a.num_gpu_blocks = pool["engine_args"]["num_gpu_blocks"]

    w = build_workload(a)
    oracle = simulate(w, a, oracle_chooser(a.workers, a.concurrency))
    print(f"oracle (simulated) hit rate: {oracle:.3f}", flush=True)
    tag = f"{os.getpid()}"
    res: dict[str, dict] = {}
    for mode in a.modes.split(","):
        r = asyncio.run(run_mode(mode, w, a, tag))
        r["replayed_hit_rate"] = replayed_hit_rate(w, a, r["assignment"])
        res[mode] = r
        print(json.dumps({k: v for k, v in r.items() if k != "assignment"}), flush=True)
    cmd = ".venv/bin/python bench/shared_prefix.py " + " ".join(sys.argv[1:])
    body = render(a, res, oracle, cmd.strip())
    print(body)
    if a.json:
        a.json.write_text(json.dumps({"oracle_hit_rate": oracle, "results": res}, indent=1))
    if a.write:
        write_section(a.write, SECTION, body, READING)
    return 0 if all(r["errors"] == 0 for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
