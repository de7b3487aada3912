"""The SLA planner in deployments started as users start them (``python -m actors.supervisor``), driven
by OpenAI traffic over HTTP and watched over NATS (what ``nats sub``/``nats req`` show).

Throughput mode reads a profile file; these tests write one by hand whose rates make the answer
computable (a mocker at a high speedup is far faster than the profile says, so latency is never the
question here: the replica counts the profile implies are). Decisions come every 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import nats

from actors.planner.contract import DecodePoint, PrefillPoint, Profile
from tests.e2e.conftest import PY, ROOT, Deployment, http_text, post

# One engine: 560 prompt tokens/s within TTFT, 64 generated tokens/s within ITL (any context).
# A request is 176 prompt tokens (as the mocker's tokenizer counts PROMPT behind an 8-digit id: the
# decisions' reasons say "ISL 176") and 20 generated ones. So 1 req/s needs 0.31 engines per pool
# (1 replica) and 8 req/s needs 1400 / 560 = 2.5 prefill and 160 / 64 = 2.5 decode engines (3
# replicas each): halfway between two replica counts, so a window that saw 20% more or fewer
# requests than the rate still asks for exactly 3, and the targets below are exact.
PREFILL_RATE = 560.0
DECODE_RATE = 64.0
MAX_TOKENS = 20
PROMPT = "the quick brown fox jumps over the lazy dog " * 8
INTERVAL = 2.0


def write_profiles(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    common = {"engine": "mocker", "model": "tiny", "made_by": "hand-written for tests", "made_at": time.time(),
              "kv_capacity_tokens": 1 << 20, "max_num_seqs": 256}
    prefill = Profile(pool="prefill", role="prefill", **common, prefill=[
        PrefillPoint(isl=isl, concurrency=1, ttft_ms=isl / PREFILL_RATE * 1000, tokens_per_s=PREFILL_RATE)
        for isl in (16, 256, 4096)])
    decode = Profile(pool="decode", role="decode", **common, decode=[
        DecodePoint(context=ctx, concurrency=c, itl_ms=5.0, tokens_per_s=DECODE_RATE)
        for ctx in (16, 256, 4096) for c in (1, 64)])
    for p in (prefill, decode):
        (d / f"{p.pool}.json").write_bytes(msgspec.json.encode(p))


def planner_sets(tmp: Path, **extra: Any) -> list[str]:
    sets = {"planner.enabled": "true", "planner.mode": "throughput", "planner.interval": str(INTERVAL),
            "planner.predictor": "constant", "planner.profile_dir": str(tmp / "profiles"),
            "planner.start_backoff.initial": "2", "planner.start_backoff.max": "8",
            "pools.prefill.engine_args.speedup_ratio": "50", "pools.decode.engine_args.speedup_ratio": "50",
            **extra}
    return [f"{k}={v}" for k, v in sets.items()]


class Traffic:
    """Completions at ``rate`` requests/s from a thread pool until stopped; every status is kept."""

    def __init__(self, url: str, rate: float) -> None:
        self.url, self.rate = url, rate
        self.codes: list[tuple[int, str]] = []
        self._ids = itertools.count(random.randrange(1 << 20))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def set_rate(self, rate: float) -> None:
        self.rate = rate

    def _one(self) -> None:
        # a prompt of its own: the KV hit rate would otherwise shrink the prefill demand to nothing;
        # a fixed-width id: every prompt is the same number of tokens
        prompt = f"{next(self._ids):08d} {PROMPT}"
        code, _, text = post(f"{self.url}/v1/completions", {"model": "tiny", "prompt": prompt,
                                                            "max_tokens": MAX_TOKENS, "ignore_eos": True},
                             timeout=60)
        self.codes.append((code, text[:200]))

    def _run(self) -> None:
        with ThreadPoolExecutor(64) as ex:
            nxt = time.monotonic()
            while not self._stop.is_set():
                if self.rate <= 0:
                    time.sleep(0.05)
                    nxt = time.monotonic()
                    continue
                ex.submit(self._one)
                nxt += 1.0 / self.rate
                time.sleep(max(0.0, nxt - time.monotonic()))

    def failures(self) -> list[tuple[int, str]]:
        return [c for c in self.codes if c[0] != 200]


async def nats_json(url: str, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    nc = await nats.connect(url)
    try:
        msg = await nc.request(subject, json.dumps(body or {}).encode(), timeout=10)
        assert not (msg.headers or {}).get("Nats-Service-Error"), (msg.headers, msg.data)
        return json.loads(msg.data)
    finally:
        await nc.close()


def newest_decisions(d: Deployment, limit: int) -> list[dict[str, Any]]:
    """The planner's newest decisions; none while no planner answers (one starting up)."""
    try:
        return asyncio.run(nats_json(d.bus_url, f"{d.namespace}.planner.decisions", {"limit": limit}))["decisions"]
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return []


def pool_children(d: Deployment, host: str = "local") -> dict[str, list[str]]:
    """Replicas per pool the root runs (its children view, as ``nats req ... children``)."""
    view = asyncio.run(nats_json(d.bus_url, f"{d.namespace}.supervisor.{host}.children"))
    out: dict[str, list[str]] = {}
    for c in view["children"]:
        pool = (c.get("meta") or {}).get("pool")
        if pool and c["state"] != "stopped":
            out.setdefault(pool, []).append(c["id"])
    return out


def counts(d: Deployment) -> dict[str, int]:
    return {p: len(ids) for p, ids in pool_children(d).items()}


@contextlib.contextmanager
def deployment(tmp: Path, name: str, sets: list[str], args: tuple[str, ...] = (), **kw: Any
               ) -> Iterator[Deployment]:
    d = Deployment("mocker-planner.toml", tmp, namespace=f"pl{name}{os.getpid()}", sets=sets, **kw)
    d.args += list(args)
    d.start()
    try:
        d.wait_ready({"prefill": 1, "decode": 1}, timeout=60)
        yield d
    finally:
        code = d.stop()
        assert code == 0, f"supervisor exited with {code}:\n{d.output()}"
        assert not d.leftovers, "processes of the deployment outlived it"


def test_throughput_mode_scales_each_pool_up_and_back_without_failing_a_request(tmp_path: Path) -> None:
    """1 req/s: one replica per pool; 8 req/s: the profile asks for 3 per pool (800 prompt tokens/s
    over 300 per engine, 160 generated tokens/s over 60); 1 req/s again: back to 1 per pool, each
    stop a drain, while requests keep arriving and none fails."""
    write_profiles(tmp_path / "profiles")
    with deployment(tmp_path, "tp", planner_sets(tmp_path)) as d, Traffic(d.url, 1.0) as traffic:
        time.sleep(3 * INTERVAL)
        assert counts(d) == {"prefill": 1, "decode": 1}
        traffic.set_rate(8.0)
        d.wait_until(lambda: counts(d) == {"prefill": 3, "decode": 3}, 60, "scaled up to 3 + 3")
        time.sleep(2 * INTERVAL)
        assert counts(d) == {"prefill": 3, "decode": 3}  # and not beyond
        decisions = asyncio.run(nats_json(d.bus_url, f"{d.namespace}.planner.decisions", {"limit": 50}))
        ups = [p for dec in decisions["decisions"] for p in dec["pools"] if p["target"] > p["current"]]
        assert ups and all("rate" in p["reason"] or "req" in p["reason"] for p in ups), ups
        metrics = http_text(f"{d.url}/metrics")  # the planner's series beside the frontend's
        assert 'vllm_actors_planner_replicas{kind="target",pool="decode"}' in metrics
        assert 'vllm_actors_planner_scale_actions_total{kind="spawn",outcome="ok",pool="decode"}' in metrics
        # back to 1 req/s (one replica per pool, as at the start): requests keep arriving while
        # replicas drain and stop (at least two intervals: one change per pool at a time)
        traffic.set_rate(1.0)
        at_drain = len(traffic.codes)
        d.wait_until(lambda: counts(d) == {"prefill": 1, "decode": 1}, 60, "scaled back to 1 + 1")
        status = asyncio.run(nats_json(d.bus_url, f"{d.namespace}.planner.status"))
        during_drain = len(traffic.codes) - at_drain
    assert not traffic.failures(), traffic.failures()[:5]
    assert at_drain >= 3 * INTERVAL and during_drain >= 1, (at_drain, during_drain)
    assert {p["pool"]: p["current"] for p in status["pools"]} == {"prefill": 1, "decode": 1}
    log = d.output(200_000)
    assert "planner: stop worker-prefill-" in log and "planner: spawn worker-decode-" in log


def test_no_op_mode_decides_and_publishes_but_changes_nothing(tmp_path: Path) -> None:
    write_profiles(tmp_path / "profiles")
    with deployment(tmp_path, "noop", planner_sets(tmp_path, **{"planner.no_op": "true"})) as d:

        async def watch(seconds: float) -> list[dict[str, Any]]:
            nc = await nats.connect(d.bus_url)
            sub = await nc.subscribe(f"{d.namespace}.planner.decision")
            got = []
            end = time.monotonic() + seconds
            with contextlib.suppress(nats.errors.TimeoutError):
                while time.monotonic() < end:
                    got.append(json.loads((await sub.next_msg(timeout=end - time.monotonic())).data))
            await nc.close()
            return got

        with Traffic(d.url, 8.0):
            time.sleep(INTERVAL)
            seen = asyncio.run(watch(4 * INTERVAL))
        assert counts(d) == {"prefill": 1, "decode": 1}
    assert seen and all(dec["no_op"] for dec in seen)
    wanted = [p for dec in seen for p in dec["pools"] if p["target"] > p["current"]]
    assert wanted, seen  # the same decisions as a planner that acts: 3 per pool under this load
    assert max(p["target"] for p in wanted) == 3, wanted
    # once the window is full of 8 req/s: exactly 3 per pool
    assert {p["pool"]: p["target"] for p in seen[-1]["pools"]} == {"prefill": 3, "decode": 3}, seen[-1]
    assert all(a["outcome"] == "planned" for dec in seen for a in dec.get("actions", []))
    assert "[no-op]" in d.output(200_000)


def test_a_pool_whose_new_workers_fail_to_start_backs_off(tmp_path: Path) -> None:
    """The decode pool's replica 1 cannot start (its status port is taken): the planner's spawns of
    it fail, each is discarded by the root (not restarted), and the planner waits out a growing
    backoff instead of spawning again every interval; the deployment keeps serving."""
    write_profiles(tmp_path / "profiles")
    blocker = socket.socket()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    blocker.bind(("127.0.0.1", base + 1))
    blocker.listen()
    sets = planner_sets(tmp_path, **{"pools.decode.status_port": str(base),
                                     "planner.pools.prefill.managed": "false"})
    try:
        with deployment(tmp_path, "fail", sets) as d, Traffic(d.url, 8.0) as traffic:
            time.sleep(24)
            log = d.output(400_000)
            attempts = log.count("planner: spawn worker-decode-1 on ")
            view = asyncio.run(nats_json(d.bus_url, f"{d.namespace}.supervisor.local.children"))
            kids = [c for c in view["children"] if (c.get("meta") or {}).get("pool") and c["state"] != "stopped"]
            running = sorted(c["id"] for c in kids if c["state"] == "running")
            assert running == ["worker-decode-0", "worker-prefill-0"], kids
            # besides them, at most the planner's next attempt, starting now (they come every 2-8 s,
            # so one can be under way at any moment); never a failed one being restarted
            assert all(c["id"] == "worker-decode-1" and c["state"] == "starting"
                       for c in kids if c["state"] != "running"), kids
            status = asyncio.run(nats_json(d.bus_url, f"{d.namespace}.planner.status"))
            assert d.proc is not None and d.proc.poll() is None
    finally:
        blocker.close()
    # 24 s at one decision per 2 s would be 12 spawns without a backoff; 2, 4, 8 s allow at most 5
    assert 1 <= attempts <= 5, attempts
    assert "discarded, not restarted" in log
    decode = next(p for p in status["pools"] if p["pool"] == "decode")
    assert decode["start_failures"] >= 1
    assert not traffic.failures(), traffic.failures()[:5]


def test_a_restarted_planner_resumes_from_the_real_replica_counts(tmp_path: Path) -> None:
    """The planner runs on a host of its own (a second ``python -m actors.supervisor --host planner``
    on the same bus, as a multi-host deployment would run it). SIGKILLed after it scaled the pools
    up and started again, its first decision counts the replicas that really run, not the
    topology's, and under the same load it neither spawns nor stops anything."""
    write_profiles(tmp_path / "profiles")
    sets = planner_sets(tmp_path, **{"planner.host": "planner"})
    with deployment(tmp_path, "rs", sets, args=("--host", "local")) as d, Traffic(d.url, 8.0) as traffic:
        args = [PY, "-m", "actors.supervisor", d.topology, *d.args[:-2], "--host", "planner",
                "--set", f"bus.url={d.bus_url}"]

        def start_planner(log: Path) -> subprocess.Popen[bytes]:
            with open(log, "wb") as out:
                return subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)

        first = start_planner(tmp_path / "planner1.log")
        try:
            d.wait_until(lambda: counts(d) == {"prefill": 3, "decode": 3}, 60, "scaled up to 3 + 3")
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(10)
        second = start_planner(tmp_path / "planner2.log")
        try:
            got = d.wait_until(lambda: newest_decisions(d, 1), 60, "a decision of the restarted planner")
            first_decision = got[0]
            assert first_decision["seq"] == 1  # the new planner's own first decision
            assert {p["pool"]: p["current"] for p in first_decision["pools"]} == {"prefill": 3, "decode": 3}
            assert {p["pool"]: p["target"] for p in first_decision["pools"]} == {"prefill": 3, "decode": 3}
            time.sleep(3 * INTERVAL)
            assert counts(d) == {"prefill": 3, "decode": 3}
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    assert not traffic.failures(), traffic.failures()[:5]
    log = (tmp_path / "planner2.log").read_text()
    assert "planner: spawn " not in log and "planner: stop " not in log, log[-2000:]
