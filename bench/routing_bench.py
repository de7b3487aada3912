"""KV-aware routing over four workloads, each against an oracle: ours (round_robin, kv) vs NVIDIA Dynamo.

    .venv/bin/python bench/routing_bench.py [--workloads shared_prefix,multi_turn,random,zipf]
        [--sides round_robin,kv,dynamo_kv] [--repeats 1] [--order given|rotate] [--scale 1.0]
        [--seed 0] [--json FILE] [--write docs/benchmarks.md] [--dynamo-venv DIR]

Every (workload, side) pair gets a fresh stack (caches cold, own ports), one after another.

Sides:

- ``round_robin``, ``kv``, ``kv@S`` (any other name not starting with ``dynamo_``): our stack,
  ``python -m actors.supervisor topologies/mocker-kv.toml`` through bench/deployment.py with
  ``frontend.router`` set to the name (``kv@S``: the kv router with ``frontend.prefill_load_scale=S``;
  plain ``kv`` runs whatever the topology and the router's defaults say). The worker of each request
  comes from our ``x-worker-instance-id`` response header.
- ``dynamo_kv`` / ``dynamo_rr``: NVIDIA Dynamo 1.6.1's ``dynamo.frontend --router-mode kv`` /
  ``round-robin`` + ``dynamo.mocker`` (bench/frontend_bench.py's ``Dynamo``: free ports, its own
  nats-server, file discovery) with the mocker sized like our topology (read from the TOML):
  ``--num-workers``, ``--speedup-ratio``, ``--block-size``, ``--num-gpu-blocks-override``,
  ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--enable-prefix-caching``. Its venv:
  ``--dynamo-venv DIR`` or ``$DYNVV``. Ready = /v1/models lists ``tiny`` and all workers are in its
  file discovery store, then warm-up requests. Dynamo reports ``usage.prompt_tokens_details.
  cached_tokens`` like ours; it sends no worker header, so each request asks for
  ``nvext.extra_fields = ["worker_id", "timing"]`` and the worker comes from the response's
  ``nvext.worker_id.decode_worker_id`` (its router's predicted ``kv_hit_rate`` from ``nvext.timing``).
  Both take ``ignore_eos`` at the top level of the body (Dynamo's ``nvext`` rejects one).
  Its stack is stopped with SIGINT (SIGKILL after 20 s), then anything of its trees still alive.

Workloads (request counts times ``--scale``, for shared_prefix its prompts per group, at least 2;
streamed, ``ignore_eos``, 64 output tokens):

- ``shared_prefix``: bench/shared_prefix.py's workload: 64 groups x 16 prompts of a 2048-token group
  prefix + a 128-token question, shuffled, token-id prompts to /v1/completions, 32 in flight.
- ``multi_turn``: 64 chat sessions x 6 turns to /v1/chat/completions (messages: the chat template
  and the frontend's tokenizer are in the path). Turn 1 = a ~900-token system message + a ~100-token
  user message; each later turn appends the assistant reply text the server actually returned and a
  new ~100-token user message. A session's turns are sequential, 32 sessions are active at once
  (a finished session makes room for the next).
- ``random``: 1024 prompts of random words, 1024-2048 tokens each (uniform), no prefix shared
  between any two, token-id prompts, 32 in flight.
- ``zipf``: 1024 requests over 64 prefix groups (2048-token prefix + 128-token distinct question)
  whose popularity is Zipf (weight of the k-th group 1/k^s, s = 1.1), drawn with the seed; 32 in
  flight. Reported also: the largest worker's share of requests over the fair share (requests /
  workers).

Oracles (hits count full 16-token blocks, as the engines' ``cached_tokens`` do):

- ``shared_prefix``, ``zipf``, ``random``: the request sequence replayed through bench/prefix_sim.py
  (per-worker LRU of the engines' capacity, one request at a time), each request sent to the worker
  with the longest cached prefix (ties: fewest of the last ``concurrency`` requests). For ``random``
  this is 0 % (nothing is shared). The same replay of the worker each request really went to is the
  *sim. of its choices* column (a check of the simulation against the engines' numbers).
- ``multi_turn``: per request, from the side's own usage numbers: the first turn of a session
  misses; turn t > 1 can at best reuse the whole previous turn of its session, i.e. its
  prompt_tokens + completion_tokens, rounded down to whole blocks (and at most the current prompt's
  whole blocks) -- if it stays on the worker holding it. Oracle = sum of those / sum of
  prompt_tokens. It is computed per side (the reply texts, hence the prompt lengths, differ). It is
  an upper bound that may not be reachable exactly: the reply text is re-tokenized inside the next
  prompt (the tokens need not be those generated) and the last generated token has no KV; the
  *prev-prompt* bound printed beside it counts the previous prompt only. Whether every session's
  final context fits the workers' KV (so that capacity does not lower the oracle) is checked and
  printed.

Reported per workload and side: TTFT p50/p99, TTFT p99 without the requests sent at once when the run
starts (they meet cold caches and empty queues together and set most of the plain p99), ITL p50 (first
token: the first chunk carrying text, a chat stream's role-only announcement and a text-less finish
chunk excluded), requests/s, hit rate =
sum(cached_tokens) / sum(prompt_tokens) from the usage, the oracle, hit rate / oracle, requests per
worker and the largest over the fair share, failed requests (a failed turn also counts the turns of
its session not sent). ``--repeats N`` runs the whole set N times (``--order rotate`` rotates the
sides' order each time); the tables give medians and then every run. An acceptance summary compares
each ``kv*`` side with ``round_robin`` and ``dynamo_kv`` of the same run (medians): reports only,
the exit status is 1 only when requests failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.kv.hashing import sequence_hashes  # noqa: E402
from bench.deployment import Deployment  # noqa: E402
from bench.docs_section import write_section  # noqa: E402
from bench.frontend_bench import Dynamo  # noqa: E402
from bench.prefix_sim import fixed_chooser, oracle_chooser, replay  # noqa: E402
from bench.shared_prefix import (  # noqa: E402
    WORDS,
    build_workload,
    fan_out,
    pct,
    scrape_router_hit_rate,
    text_tokens,
    tokenizer,
)
from bench.sse import SseStream, TokenClock  # noqa: E402

TOPOLOGY = "topologies/mocker-kv.toml"
SECTION = "KV routing: four workloads"
READING = "<!-- hand-written from here on: bench/routing_bench.py --write keeps it -->"
WORKLOADS = ("shared_prefix", "multi_turn", "random", "zipf")
DYNAMO_MODES = {"dynamo_kv": "kv", "dynamo_rr": "round-robin"}


@dataclass(frozen=True)
class Topo:
    workers: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    speedup_ratio: float


def read_topology() -> Topo:
    topo = tomllib.loads((ROOT / TOPOLOGY).read_text())
    pool = next(iter(topo["pools"].values()))
    ea = pool["engine_args"]
    return Topo(pool["replicas"], ea["block_size"], ea["num_gpu_blocks"], ea["max_num_seqs"],
                ea["max_num_batched_tokens"], float(ea.get("speedup_ratio", 1.0)))


# --- workloads -------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    concurrency: int
    output_tokens: int
    describe: str
    prompts: list[list[int]] = field(default_factory=list)  # token-id workloads, in send order
    sessions: list[list[str]] = field(default_factory=list)  # multi_turn: [system, user 1, user 2, ...]
    oracle: float | None = None  # simulated (token-id workloads); multi_turn: per side from its usage
    oracle_per_worker: list[int] | None = None

    @property
    def chat(self) -> bool:
        return bool(self.sessions)

    @property
    def turns(self) -> int:
        return len(self.sessions[0]) - 1 if self.sessions else 0

    @property
    def requests(self) -> int:
        return len(self.sessions) * self.turns if self.chat else len(self.prompts)


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def words_text(tok, rng: random.Random, head: str, n: int) -> str:
    """Word text of about ``n`` tokens (whole words, the first ones past ``n`` tokens dropped)."""
    words = [head]
    while len(tok.encode(" ".join(words), add_special_tokens=False).ids) < n:
        words.extend(rng.choice(WORDS) for _ in range(8))
    return " ".join(words)


def shared_prefix_workload(a: argparse.Namespace) -> Workload:
    ns = argparse.Namespace(groups=64, per_group=max(2, scaled(16, a.scale)), prefix_tokens=2048, question_tokens=128,
                            seed=a.seed)
    w = build_workload(ns)
    return Workload("shared_prefix", a.concurrency, a.output_tokens, prompts=w.prompts, describe=(
        f"{ns.groups} groups × {ns.per_group} prompts = {len(w.prompts)} requests of a {ns.prefix_tokens}-token "
        f"group prefix + a {ns.question_tokens}-token question (bench/shared_prefix.py's workload), shuffled, "
        f"token ids to `/v1/completions`, {a.concurrency} in flight"))


def zipf_workload(tok, a: argparse.Namespace) -> Workload:
    rng = random.Random(a.seed + 3)
    groups, n = 64, scaled(1024, a.scale)
    prefixes = [text_tokens(tok, rng, f"System prompt {g}: you are assistant number {g}.", 2048)
                for g in range(groups)]
    weights = [1 / (k + 1) ** a.zipf_s for k in range(groups)]
    drawn = rng.choices(range(groups), weights=weights, k=n)
    prompts = [prefixes[g] + text_tokens(tok, rng, f"Question {i} of group {g}:", 128) for i, g in enumerate(drawn)]
    top = max(drawn.count(g) for g in range(groups))
    return Workload("zipf", a.concurrency, a.output_tokens, prompts=prompts, describe=(
        f"{n} requests over {groups} groups (2048-token prefix + 128-token distinct question) drawn with "
        f"Zipf popularity s = {a.zipf_s} (seed {a.seed}): {len(set(drawn))} groups used, the most popular "
        f"has {top} requests ({100 * top / n:.0f} %); token ids to `/v1/completions`, {a.concurrency} in flight"))


def random_workload(tok, a: argparse.Namespace) -> Workload:
    rng = random.Random(a.seed + 2)
    n = scaled(1024, a.scale)
    prompts = [text_tokens(tok, rng, f"Request {i}:", rng.randint(1024, 2048)) for i in range(n)]
    return Workload("random", a.concurrency, a.output_tokens, prompts=prompts, describe=(
        f"{n} prompts of random words, 1024–2048 tokens (uniform, mean "
        f"{sum(map(len, prompts)) / n:.0f}), nothing shared; token ids to `/v1/completions`, "
        f"{a.concurrency} in flight"))


def multi_turn_workload(tok, a: argparse.Namespace) -> Workload:
    rng = random.Random(a.seed + 1)
    n = scaled(a.mt_sessions, a.scale)
    sessions = [[words_text(tok, rng, f"System prompt of session {s}: you are assistant number {s}.", 900),
                 *(words_text(tok, rng, f"Session {s}, turn {t + 1}:", 100) for t in range(a.mt_turns))]
                for s in range(n)]
    c = min(a.mt_concurrency, n)
    return Workload("multi_turn", c, a.output_tokens, sessions=sessions, describe=(
        f"{n} chat sessions × {a.mt_turns} turns = {n * a.mt_turns} requests to `/v1/chat/completions`: "
        f"turn 1 = a ~900-token system + a ~100-token user message, each later turn appends the returned "
        f"assistant text + a new ~100-token user message; turns sequential, {c} sessions active at once"))


def build(name: str, tok, a: argparse.Namespace) -> Workload:
    if name == "shared_prefix":
        return shared_prefix_workload(a)
    if name == "zipf":
        return zipf_workload(tok, a)
    if name == "random":
        return random_workload(tok, a)
    return multi_turn_workload(tok, a)


# --- oracles ---------------------------------------------------------------------------------------
def replay_prompts(prompts: list[list[int]], topo: Topo, output_tokens: int, choose) -> dict[str, Any]:
    bs = topo.block_size
    hashes = [sequence_hashes(p, bs) for p in prompts]
    # blocks a request adds after its prompt's full blocks (its question's partial block + output)
    tail = round(statistics.mean((len(p) + output_tokens - 1) // bs - len(p) // bs for p in prompts))
    out = replay(hashes, topo.workers, topo.num_gpu_blocks, tail, choose)
    counts = [out["workers"].count(k) for k in range(topo.workers)]
    return {"hit_rate": sum(out["hit_blocks"]) * bs / sum(map(len, prompts)), "per_worker": counts}


def replay_choices(prompts: list[list[int]], topo: Topo, output_tokens: int, assignment: list[str]) -> float | None:
    if not assignment or not all(assignment):
        return None
    index = {wk: i for i, wk in enumerate(sorted(set(assignment)))}
    if len(index) > topo.workers:
        return None
    return replay_prompts(prompts, topo, output_tokens, fixed_chooser([index[wk] for wk in assignment]))["hit_rate"]


def multi_turn_oracle(w: Workload, results: list[Result | None], topo: Topo) -> dict[str, Any]:
    """The multi_turn oracle (see the module docstring) from one side's usage numbers."""
    bs, T = topo.block_size, w.turns
    best = prev_prompt_only = prompt = 0
    footprints = []
    for s in range(len(w.sessions)):
        last = None
        for t in range(T):
            r = results[s * T + t]
            if r is None:
                break
            prompt += r.prompt_tokens
            if last is not None:
                cap = r.prompt_tokens // bs
                best += min((last.prompt_tokens + last.completion_tokens) // bs, cap) * bs
                prev_prompt_only += min(last.prompt_tokens // bs, cap) * bs
            last = r
        if last is not None:
            footprints.append(math.ceil((last.prompt_tokens + last.completion_tokens) / bs))
    capacity = topo.workers * topo.num_gpu_blocks
    active = sum(sorted(footprints, reverse=True)[:w.concurrency])
    return {"oracle": best / prompt if prompt else float("nan"),
            "oracle_prev_prompt": prev_prompt_only / prompt if prompt else float("nan"),
            "sessions_blocks": sum(footprints), "active_blocks": active, "capacity_blocks": capacity,
            "all_fit": sum(footprints) <= capacity}


# --- client ----------------------------------------------------------------------------------------
@dataclass
class Result:
    ttft: float
    itls: list[float]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    worker: str
    text: str
    router_hit: float | None  # Dynamo's nvext.timing.kv_hit_rate (its router's prediction)
    response_id: str = ""  # the response's id: joins a request with the router's debug log
    sent: float = 0.0  # time.perf_counter() when it was sent


@dataclass
class Run:
    results: list[Result | None]
    errors: list[str] = field(default_factory=list)
    wall: float = float("nan")


def is_token_chunk(msg: dict[str, Any]) -> bool:
    """A chunk that carries generated text, or an empty piece of it (a partial UTF-8 character); not a
    chat stream's role announcement nor a finish chunk without text."""
    for c in msg.get("choices") or ():
        delta = c.get("delta") or {}
        text = c.get("text") if "text" in c else delta.get("content")
        if text:
            return True
        if c.get("finish_reason") is None and "role" not in delta:
            return True
    return False


async def request(http: aiohttp.ClientSession, side: Side, body: dict[str, Any], chat: bool,
                  max_tokens: int) -> Result:
    body = {"model": "tiny", **body, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **side.extra_body}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    clock = TokenClock()
    usage: dict[str, Any] = {}
    text: list[str] = []
    nvext: dict[str, Any] = {}
    response_id = ""
    async with http.post(side.url + path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        worker = r.headers.get("x-worker-instance-id", "")
        async for msg in SseStream().events(r.content):
            if "error" in msg:
                raise RuntimeError(str(msg["error"])[:200])
            if msg.get("usage"):
                usage = msg["usage"]
            response_id = response_id or str(msg.get("id") or "")
            for k, v in (msg.get("nvext") or {}).items():
                nvext[k] = v
            for c in msg.get("choices") or ():
                text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
            if is_token_chunk(msg):
                clock.tick()
    if not usage:
        raise RuntimeError("stream ended without usage")
    if not worker and nvext.get("worker_id"):
        worker = str(nvext["worker_id"].get("decode_worker_id") or "")
    details = usage.get("prompt_tokens_details") or {}
    return Result(ttft=clock.ttft, itls=clock.itls,
                  prompt_tokens=usage.get("prompt_tokens") or 0, cached_tokens=details.get("cached_tokens") or 0,
                  completion_tokens=usage.get("completion_tokens") or 0, worker=worker, text="".join(text),
                  router_hit=(nvext.get("timing") or {}).get("kv_hit_rate"), response_id=response_id,
                  sent=clock.sent)


async def drive_tokens(side: Side, w: Workload) -> Run:
    return await fan_out(Run(results=[None] * w.requests), w.requests, w.concurrency,
                         lambda http, i: request(http, side, {"prompt": w.prompts[i], "skip_special_tokens": False},
                                                 False, w.output_tokens))


async def drive_chat(side: Side, w: Workload) -> Run:
    T = w.turns
    run = Run(results=[None] * w.requests)
    queue = list(range(len(w.sessions)))[::-1]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                     connector=aiohttp.TCPConnector(limit=w.concurrency)) as http:
        async def client() -> None:
            while queue:
                s = queue.pop()
                system, *users = w.sessions[s]
                messages = [{"role": "system", "content": system}, {"role": "user", "content": users[0]}]
                for t in range(T):
                    try:
                        r = await request(http, side, {"messages": messages}, True, w.output_tokens)
                    except Exception as e:  # counted, and so are the session's turns not sent
                        run.errors.append(f"session {s} turn {t + 1}: {e!r}")
                        run.errors += [f"session {s} turn {k + 1}: not sent" for k in range(t + 1, T)]
                        break
                    run.results[s * T + t] = r
                    if t + 1 < T:
                        messages = [*messages, {"role": "assistant", "content": r.text},
                                    {"role": "user", "content": users[t + 1]}]

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(w.concurrency)))
        run.wall = time.perf_counter() - t0
    return run


# --- sides -----------------------------------------------------------------------------------------
class Side:
    name: str
    url: str
    extra_body: ClassVar[dict[str, Any]] = {}  # merged into every request body
    logs: str = ""

    async def start(self, http: aiohttp.ClientSession) -> None:
        raise NotImplementedError

    def stop(self, keep_logs: bool) -> None:
        raise NotImplementedError

    async def router_predicted(self, http: aiohttp.ClientSession, results: list[Result]) -> float | None:
        return None


class Ours(Side):
    def __init__(self, mode: str, topo: Topo, tag: str) -> None:
        self.name, self.topo = mode, topo
        self.dep = Deployment(TOPOLOGY, mode, tag)
        self.url = self.dep.url
        self.logs = str(self.dep.log_path)

    async def start(self, http: aiohttp.ClientSession) -> None:
        self.dep.start()
        await self.dep.wait_ready(http, self.topo.workers, timeout=180)

    def stop(self, keep_logs: bool) -> None:
        self.dep.stop()
        if not keep_logs:
            shutil.rmtree(self.dep.run_dir, ignore_errors=True)

    async def router_predicted(self, http: aiohttp.ClientSession, results: list[Result]) -> float | None:
        return await scrape_router_hit_rate(self.url) if self.name.startswith("kv") else None


class DynamoSide(Side):
    # (Dynamo takes ignore_eos at the top level, as ours does; its nvext rejects it)
    extra_body: ClassVar[dict[str, Any]] = {"nvext": {"extra_fields": ["worker_id", "timing"]}}

    def __init__(self, name: str, topo: Topo, venv: pathlib.Path) -> None:
        self.name, self.topo, self.venv = name, topo, venv
        self.logdir = pathlib.Path(tempfile.mkdtemp(prefix=f"routing-{name}-"))
        self.logs = str(self.logdir)
        self.stack: Dynamo | None = None
        self.url = ""

    async def start(self, http: aiohttp.ClientSession) -> None:
        from actors.models.tiny import ensure_tiny_model

        t = self.topo
        self.stack = Dynamo(DYNAMO_MODES[self.name], t.workers, self.logdir, self.venv, ensure_tiny_model(),
                            speedup=str(t.speedup_ratio), mocker_args=(
                                "--block-size", str(t.block_size), "--num-gpu-blocks-override", str(t.num_gpu_blocks),
                                "--max-num-seqs", str(t.max_num_seqs),
                                "--max-num-batched-tokens", str(t.max_num_batched_tokens), "--enable-prefix-caching"))
        self.url = f"http://127.0.0.1:{self.stack.port}"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 180:
            for p in self.stack.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"Dynamo pid {p.pid} exited with {p.returncode}; logs {self.logdir}")
            models = ""
            try:
                async with http.get(self.url + "/v1/models") as r:
                    models = await r.text()
            except (TimeoutError, aiohttp.ClientError):
                pass
            if '"tiny"' in models and self.registered() >= t.workers:
                print(f"  [{self.name}] up after {time.monotonic() - t0:.1f}s (logs {self.logdir})", file=sys.stderr)
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"Dynamo not up with {t.workers} workers after 180s; logs {self.logdir}")

    def registered(self) -> int:
        """Workers in Dynamo's file discovery store (one ``<ns>/backend/generate/<id>`` entry each)."""
        d = self.logdir / "kv" / "v1" / "instances"
        names = [urllib.parse.unquote(p.name) for p in d.iterdir()] if d.is_dir() else []
        return sum(1 for n in names if re.search(r"/generate/[0-9a-f]+$", n))

    def stop(self, keep_logs: bool) -> None:
        if self.stack is not None:
            self.stack.stop()
        if not keep_logs:
            shutil.rmtree(self.logdir, ignore_errors=True)

    async def router_predicted(self, http: aiohttp.ClientSession, results: list[Result]) -> float | None:
        if self.name != "dynamo_kv":
            return None
        rs = [r for r in results if r.router_hit is not None]
        prompt = sum(r.prompt_tokens for r in rs)
        return sum(r.router_hit * r.prompt_tokens for r in rs) / prompt if prompt else None


def make_side(name: str, a: argparse.Namespace, topo: Topo) -> Side:
    if name in DYNAMO_MODES:
        return DynamoSide(name, topo, a.dynamo_venv)
    return Ours(name, topo, f"{os.getpid()}")


async def warm_up(side: Side, w: Workload, topo: Topo) -> None:
    """Requests that leave nothing in the caches that the workload could hit: token prompts shorter than
    one block, and (chat) a one-word user message with no system message (every session starts with one)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        jobs = [request(http, side, {"prompt": [7 + k] * 8}, False, 1) for k in range(2 * topo.workers)]
        if w.chat:
            jobs += [request(http, side, {"messages": [{"role": "user", "content": "hi"}]}, True, 1)
                     for _ in range(2)]
        await asyncio.gather(*jobs)
    await asyncio.sleep(1.0)  # let a kv router follow every worker's event stream


async def run_one(w: Workload, side_name: str, a: argparse.Namespace, topo: Topo) -> dict[str, Any]:
    side = make_side(side_name, a, topo)
    run = Run(results=[None] * w.requests)
    predicted = None
    t_start = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            await side.start(http)
        await warm_up(side, w, topo)
        run = await (drive_chat if w.chat else drive_tokens)(side, w)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            predicted = await side.router_predicted(http, [r for r in run.results if r is not None])
    except Exception as e:  # the stack did not come up or went away: every request not served counts
        run.errors.append(f"{side_name}: {e!r}")
    finally:
        ok = sum(1 for r in run.results if r is not None)
        side.stop(keep_logs=a.keep_logs or ok < w.requests)
    if a.keep_logs:
        print(f"  [{side_name}] logs kept in {side.logs}", file=sys.stderr)
    if ok < w.requests:
        print(f"  [{side_name}] {w.requests - ok} requests failed; logs kept in {side.logs}", file=sys.stderr)
    s = summarize(w, side_name, run, topo, predicted)
    s["seconds_total"] = time.monotonic() - t_start
    return s


# --- numbers ---------------------------------------------------------------------------------------
def summarize(w: Workload, side: str, run: Run, topo: Topo, predicted: float | None) -> dict[str, Any]:
    ok = [r for r in run.results if r is not None]
    ttfts = [r.ttft for r in ok]
    # the requests sent at once at the start (cold caches, empty queues): they set most of a p99
    burst = {s * w.turns for s in range(w.concurrency)} if w.chat else set(range(w.concurrency))
    steady = [r.ttft for i, r in enumerate(run.results) if r is not None and i not in burst]
    prompt = sum(r.prompt_tokens for r in ok)
    first_sent = min((r.sent for r in ok), default=0.0)
    assignment = [r.worker if r is not None else "" for r in run.results]
    per_worker = None
    max_over_fair = float("nan")
    if ok and all(r.worker for r in ok):
        counts = [sum(1 for r in ok if r.worker == wk) for wk in sorted({r.worker for r in ok})]
        per_worker = sorted(counts + [0] * max(0, topo.workers - len(counts)))
        max_over_fair = max(per_worker) / (len(ok) / len(per_worker))
    out: dict[str, Any] = {
        "workload": w.name, "side": side, "requests": len(ok), "errors": w.requests - len(ok),
        "error_samples": run.errors[:3], "wall_s": run.wall,
        "ttft_p50_ms": 1e3 * pct(ttfts, 0.5), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
        "ttft_p99_steady_ms": 1e3 * pct(steady, 0.99),
        "itl_p50_ms": 1e3 * pct([x for r in ok for x in r.itls], 0.5),
        "req_per_s": len(ok) / run.wall if run.wall == run.wall and run.wall > 0 else float("nan"),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan"),
        "short_completions": sum(1 for r in ok if r.completion_tokens != w.output_tokens),
        "requests_per_worker": per_worker, "max_over_fair": max_over_fair,
        "router_predicted_hit_rate": predicted, "assignment": assignment,
        # per request in workload order (multi_turn: session-major), for the JSON; None = failed
        "ttft_ms": [None if r is None else round(1e3 * r.ttft, 2) for r in run.results],
        "cached_tokens": [None if r is None else r.cached_tokens for r in run.results],
        "prompt_tokens": [None if r is None else r.prompt_tokens for r in run.results],
        "response_ids": [None if r is None else r.response_id for r in run.results],
        "sent_s": [None if r is None else round(r.sent - first_sent, 4) for r in run.results],
    }
    if w.chat:
        out.update(multi_turn_oracle(w, run.results, topo))
    else:
        out["oracle"] = w.oracle
        out["replayed_hit_rate"] = (replay_choices(w.prompts, topo, w.output_tokens, assignment)
                                    if len(ok) == w.requests else None)
    out["hit_over_oracle"] = out["hit_rate"] / out["oracle"] if out["oracle"] else float("nan")
    return out


# per-request lists of a run's summary: in the JSON, not in the progress lines
PER_REQUEST = ("assignment", "ttft_ms", "cached_tokens", "prompt_tokens", "response_ids", "sent_s")
NUMERIC = ("requests", "errors", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_p99_steady_ms", "itl_p50_ms", "req_per_s", "hit_rate",
           "oracle", "hit_over_oracle", "replayed_hit_rate", "max_over_fair", "router_predicted_hit_rate",
           "oracle_prev_prompt", "short_completions")


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for k in NUMERIC:
        xs = [r[k] for r in rows if isinstance(r.get(k), int | float) and r[k] == r[k]]
        out[k] = statistics.median(xs) if xs else None
    out["errors"] = sum(r["errors"] for r in rows)
    pws = [r["requests_per_worker"] for r in rows if r.get("requests_per_worker")]
    if pws and all(len(p) == len(pws[0]) for p in pws):
        out["requests_per_worker"] = [statistics.median(col) for col in zip(*pws, strict=True)]
    return out


def f_ms(x: float | None) -> str:
    return "–" if x is None or x != x else f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def f_pc(x: float | None) -> str:
    return "–" if x is None or x != x else f"{100 * x:.1f} %"


def f_num(x: float | None, fmt: str = ".1f") -> str:
    return "–" if x is None or x != x else format(x, fmt)


def table_rows(rows: list[dict[str, Any]], label) -> list[str]:
    out = []
    for r in rows:
        pw = r.get("requests_per_worker")
        pw_s = "n/a" if not pw else "[" + ", ".join(f"{x:g}" for x in pw) + "]"
        out.append(f"| {label(r)} | {f_ms(r['ttft_p50_ms'])} | {f_ms(r['ttft_p99_ms'])} | "
                   f"{f_ms(r['ttft_p99_steady_ms'])} | {f_ms(r['itl_p50_ms'])} | "
                   f"{f_num(r['req_per_s'])} | **{f_pc(r['hit_rate'])}** | {f_pc(r['oracle'])} | "
                   f"{f_pc(r['hit_over_oracle'])} | {f_pc(r.get('replayed_hit_rate'))} | "
                   f"{f_pc(r.get('router_predicted_hit_rate'))} | {pw_s} | {f_num(r['max_over_fair'], '.2f')} | "
                   f"{r['errors']} |")
    return out


HEADER = ["| side | TTFT p50 | TTFT p99 | TTFT p99 after the start | ITL p50 | req/s | hit rate | oracle | "
          "hit / oracle | sim. of its choices | router's predicted hit | requests per worker | max / fair | failed |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def render_workload(w: Workload, runs: list[dict[str, Any]], sides: list[str], repeats: int,
                    topo: Topo) -> list[str]:
    med = {s: median_row([r for r in runs if r["side"] == s]) for s in sides if any(r["side"] == s for r in runs)}
    lines = [f"### {w.name}", "", w.describe + ".", ""]
    if repeats > 1:
        lines += [f"Medians of {repeats} runs:", ""]
    lines += HEADER + table_rows(list(med.values()), lambda r: r["side"])
    if not w.chat:
        pw = w.oracle_per_worker
        fair = w.requests / len(pw) if pw else 0
        lines.append(f"| oracle (simulated) | | | | | | | **{f_pc(w.oracle)}** | | | | {sorted(pw) if pw else ''} | "
                     f"{f_num(max(pw) / fair, '.2f') if pw and fair else ''} | |")
    if repeats > 1:
        lines += ["", "Every run:", "", *HEADER]
        lines += table_rows(runs, lambda r: f"run {r['repeat'] + 1}: {r['side']}")
    notes = []
    if w.chat:
        for s, r in med.items():
            if not r.get("requests") or r.get("sessions_blocks") is None:
                continue
            notes.append(
                f"{s}: oracle {f_pc(r['oracle'])} (previous turn's prompt only: {f_pc(r['oracle_prev_prompt'])}); "
                f"the sessions' final contexts take {r['sessions_blocks']} blocks, the {w.concurrency} largest "
                f"(the most active at once) {r['active_blocks']}, of {r['capacity_blocks']} "
                f"({topo.workers} workers × {topo.num_gpu_blocks}): "
                + ("all sessions fit, capacity does not lower the oracle." if r["all_fit"]
                   else "they do NOT all fit, the oracle is above what capacity allows."))
    short = {s: r["short_completions"] for s, r in med.items() if r.get("short_completions")}
    if short:
        notes.append(f"Completions shorter or longer than {w.output_tokens} tokens (median count): {short}.")
    errs = {r["side"] + (f" (run {r['repeat'] + 1})" if repeats > 1 else ""): (r["errors"], r["error_samples"])
            for r in runs if r["errors"]}
    if errs:
        notes.append(f"Failed requests: {errs}.")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return lines + [""]


def acceptance(workloads: dict[str, Workload], runs: list[dict[str, Any]], sides: list[str]) -> list[str]:
    def med(wl: str, side: str) -> dict[str, Any] | None:
        rows = [r for r in runs if r["workload"] == wl and r["side"] == side]
        return median_row(rows) if rows else None

    def check(label: str, ok: bool | None) -> str:
        return f"- {label}: " + ("SKIP" if ok is None else "PASS" if ok else "FAIL")

    def le(x: float | None, y: float | None, f: float = 1.0) -> bool | None:
        return None if x is None or y is None or x != x or y != y else x <= f * y

    def share(f: float, x: float | None) -> float | None:
        return None if x is None else f * x

    lines = []
    for wl in workloads:
        rr, dyn = med(wl, "round_robin"), med(wl, "dynamo_kv")
        for side in [s for s in sides if s.startswith("kv")]:
            kv = med(wl, side)
            if kv is None:
                continue
            g = lambda r, k: None if r is None else r.get(k)  # noqa: E731
            p50, p99, hit, orc = kv["ttft_p50_ms"], kv["ttft_p99_ms"], kv["hit_rate"], kv["oracle"]
            if wl == "shared_prefix":
                lines += [
                    check(f"shared_prefix {side}: hit {f_pc(hit)} >= 95 % of oracle {f_pc(orc)}",
                          le(share(0.95, orc), hit)),
                    check(f"shared_prefix {side}: TTFT p50 {f_ms(p50)} <= 0.8 × round_robin's "
                          f"{f_ms(g(rr, 'ttft_p50_ms'))}", le(p50, g(rr, "ttft_p50_ms"), 0.8)),
                    check(f"shared_prefix {side}: TTFT p99 {f_ms(p99)} <= 0.8 × round_robin's "
                          f"{f_ms(g(rr, 'ttft_p99_ms'))}", le(p99, g(rr, "ttft_p99_ms"), 0.8)),
                    check(f"shared_prefix {side}: TTFT p50 {f_ms(p50)} <= dynamo_kv's {f_ms(g(dyn, 'ttft_p50_ms'))}",
                          le(p50, g(dyn, "ttft_p50_ms"))),
                    check(f"shared_prefix {side}: TTFT p99 {f_ms(p99)} <= dynamo_kv's {f_ms(g(dyn, 'ttft_p99_ms'))}",
                          le(p99, g(dyn, "ttft_p99_ms")))]
            elif wl == "multi_turn":
                lines += [
                    check(f"multi_turn {side}: TTFT p50 {f_ms(p50)} <= 0.8 × round_robin's "
                          f"{f_ms(g(rr, 'ttft_p50_ms'))}", le(p50, g(rr, "ttft_p50_ms"), 0.8)),
                    check(f"multi_turn {side}: hit {f_pc(hit)} >= 90 % of oracle {f_pc(orc)}",
                          le(share(0.9, orc), hit))]
            elif wl == "random":
                lines.append(check(f"random {side}: TTFT p99 {f_ms(p99)} <= 1.1 × round_robin's "
                                   f"{f_ms(g(rr, 'ttft_p99_ms'))}", le(p99, g(rr, "ttft_p99_ms"), 1.1)))
            elif wl == "zipf":
                mf = kv["max_over_fair"]
                lines += [
                    check(f"zipf {side}: TTFT p99 {f_ms(p99)} <= round_robin's {f_ms(g(rr, 'ttft_p99_ms'))}",
                          le(p99, g(rr, "ttft_p99_ms"))),
                    check(f"zipf {side}: largest worker {f_num(mf, '.2f')} × fair share <= 2", le(mf, 2.0))]
    return lines


def render(a: argparse.Namespace, cmd: str, topo: Topo, workloads: dict[str, Workload], runs: list[dict[str, Any]],
           sides: list[str]) -> str:
    lines = [
        f"Command: `{cmd}`", "",
        f"Topology `{TOPOLOGY}` for our sides: {topo.workers} mocker workers, {topo.num_gpu_blocks} blocks × "
        f"{topo.block_size} tokens of KV each, max_num_seqs {topo.max_num_seqs}, max_num_batched_tokens "
        f"{topo.max_num_batched_tokens}, speedup_ratio {topo.speedup_ratio:g}; Dynamo {a.dynamo_version} sides: "
        f"`dynamo.frontend --router-mode kv|round-robin` + one `dynamo.mocker --num-workers {topo.workers}` "
        f"process (ours: one process per worker) with the same sizes (`--num-gpu-blocks-override`, "
        f"`--enable-prefix-caching`; its own timing model). A fresh stack per workload and side; all "
        f"streamed, `ignore_eos`, "
        f"{a.output_tokens} output tokens. Scale {a.scale:g}, seed {a.seed}, repeats {a.repeats}, side order "
        f"{a.order}.", "",
        f"Machine: {os.uname().machine}, {os.cpu_count()} cores shared with other jobs (client, frontends, "
        "routers, NATS and mockers all on them; simulated time at speedup_ratio 1 runs alongside real CPU "
        "contention — treat differences under ~20 % as noise).", "",
        "Columns: *TTFT p99 after the start* leaves out the requests sent at once when the run starts (the "
        "first `concurrency` requests; multi_turn: the first turns of the first sessions), which meet cold "
        "caches and empty queues all together and set most of the plain p99; "
        "*hit rate* = Σ cached_tokens / Σ prompt_tokens from the responses' usage; *sim. of its "
        "choices* = the workload replayed through bench/prefix_sim.py with the worker each request really "
        "went to; *router's predicted hit* = ours: `vllm_actors_router_prefix_hit_rate` from /metrics, Dynamo: its "
        "`nvext.timing.kv_hit_rate` weighted by prompt tokens; *requests per worker*: ours from the "
        "`x-worker-instance-id` header, Dynamo from `nvext.worker_id` (asked for with "
        "`nvext.extra_fields`); *max / fair* = the largest worker's requests over requests / workers; "
        "*failed* counts failed requests and the turns of a session not sent after a failed turn.", "",
        "Oracles: shared_prefix, zipf, random: the request sequence replayed through bench/prefix_sim.py "
        "(an LRU of the engines' capacity per worker, one request at a time, so an upper bound), each request "
        f"sent to the worker with the longest cached prefix (ties: the fewest of the last {a.concurrency}); "
        "random shares nothing, so 0 %. multi_turn, per side from its own usage: a session's first turn misses, "
        "a later turn at best reuses its whole previous turn (prompt + completion tokens) rounded down to "
        f"whole {topo.block_size}-token blocks; the reply's share of that may be out of reach (the reply text is "
        "re-tokenized inside the next prompt, its last token has no KV), hence the bound from the previous "
        "turn's prompt alone beside it.", "",
    ]
    for name, w in workloads.items():
        lines += render_workload(w, [r for r in runs if r["workload"] == name], sides, a.repeats, topo)
    lines += ["### Acceptance (kv against round_robin and dynamo_kv of the same run, medians)", "",
              *acceptance(workloads, runs, sides), ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--sides", default="round_robin,kv,dynamo_kv",
                   help="ours: round_robin, kv, kv@S (any frontend.router name); Dynamo: dynamo_kv, dynamo_rr")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--order", choices=["given", "rotate"], default="given",
                   help="rotate: each repeat starts one side later")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's request count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=32, help="in flight (shared_prefix, random, zipf)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--mt-sessions", type=int, default=64)
    p.add_argument("--mt-turns", type=int, default=6)
    p.add_argument("--mt-concurrency", type=int, default=32, help="multi_turn sessions active at once")
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--dynamo-venv", type=pathlib.Path,
                   default=pathlib.Path(os.environ["DYNVV"]) if os.environ.get("DYNVV") else None,
                   help="Dynamo's virtualenv (bin/python, bin/nats-server); default $DYNVV")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep every run's logs (with BENCH_LOG_LEVEL=DEBUG: each routing decision)")
    p.add_argument("--json", type=pathlib.Path, help="write the raw results here")
    p.add_argument("--write", type=pathlib.Path, help="update the section of this markdown file")
    a = p.parse_args()
    names = [x for x in a.workloads.split(",") if x]
    sides = [x for x in a.sides.split(",") if x]
    if bad := [x for x in names if x not in WORKLOADS]:
        p.error(f"unknown workloads {bad}; choose from {WORKLOADS}")
    if bad := [x for x in sides if x.startswith("dynamo_") and x not in DYNAMO_MODES]:
        p.error(f"unknown Dynamo sides {bad}; choose from {list(DYNAMO_MODES)}")
    if any(x in DYNAMO_MODES for x in sides):
        if a.dynamo_venv is None:
            p.error("where is Dynamo's venv? give --dynamo-venv or set DYNVV (or leave the dynamo_* sides out)")
        if not (a.dynamo_venv / "bin/python").exists() or not (a.dynamo_venv / "bin/nats-server").exists():
            p.error(f"{a.dynamo_venv} has no bin/python or bin/nats-server")
    topo = read_topology()
    a.dynamo_version = "–"
    if any(x in DYNAMO_MODES for x in sides):
        a.dynamo_version = subprocess.run(
            [str(a.dynamo_venv / "bin/python"), "-c",
             "import importlib.metadata as m; print(m.version('ai-dynamo'))"],
            capture_output=True, text=True).stdout.strip() or "(version unknown)"

    tok = tokenizer()
    workloads: dict[str, Workload] = {}
    for name in names:
        t0 = time.monotonic()
        w = build(name, tok, a)
        if not w.chat:
            sim = replay_prompts(w.prompts, topo, w.output_tokens, oracle_chooser(topo.workers, w.concurrency))
            w.oracle, w.oracle_per_worker = sim["hit_rate"], sim["per_worker"]
        workloads[name] = w
        print(f"{name}: {w.requests} requests, oracle {f_pc(w.oracle) if w.oracle is not None else 'per side'} "
              f"(built in {time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)

    runs: list[dict[str, Any]] = []
    for rep in range(a.repeats):
        order = sides[rep % len(sides):] + sides[:rep % len(sides)] if a.order == "rotate" else sides
        for name, w in workloads.items():
            for side in order:
                r = asyncio.run(run_one(w, side, a, topo))
                r["repeat"] = rep
                runs.append(r)
                print(f"[run {rep + 1} {name} {side}] " + json.dumps(
                    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                     if k not in PER_REQUEST + ("workload", "side", "repeat")}), file=sys.stderr,
                    flush=True)

    cmd = (".venv/bin/python bench/routing_bench.py " + " ".join(sys.argv[1:])).strip()
    body = render(a, cmd, topo, workloads, runs, sides)
    print(body)
    if a.json:
        a.json.write_text(json.dumps({"command": cmd, "topology": topo.__dict__,
                                      "oracles": {n: w.oracle for n, w in workloads.items()},
                                      "oracle_per_worker": {n: w.oracle_per_worker for n, w in workloads.items()},
                                      "runs": runs}, indent=1))
    if a.write:
        write_section(a.write, SECTION, body, READING)
    return 0 if all(r["errors"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
