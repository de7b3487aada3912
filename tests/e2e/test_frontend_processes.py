"""The frontend as two OS processes (``--set frontend.processes=2``), started with the CLI as a user
does: mocker workers, the kv router. Every request goes over a new connection, so the kernel hands
each one to either process; each response names its process (``x-frontend-instance-id``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import nats
import pytest

from bus.subjects import Subjects
from tests.chaos import scenarios as sc
from tests.e2e.conftest import WORKER_HEADER, Deployment, boot, http_text, post, shutdown

pytestmark = pytest.mark.slow

FRONTEND_HEADER = "x-frontend-instance-id"
PROCESSES = ("frontend-local-0", "frontend-local-1")
SETS = ["frontend.processes=2", "frontend.router=kv", "pools.agg.replicas=2",
        # slow enough that a long stream is still running when a frontend process is killed
        "pools.agg.engine_args.speedup_ratio=0.5",
        f"pools.agg.engine_args.poison_token_id={sc.POISON}"]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "fe_procs", "mocker-agg.toml", ready={"agg": 2}, sets=SETS)
    # ready means one process serves; the processes start side by side, and the tests want both
    d.wait_until(lambda: re.search(r"^vllm_actors_frontend_scrape_missing 0\.0$", http_text(f"{d.url}/metrics"), re.M),
                 60, "both frontend processes answer a scrape")
    yield d
    shutdown(d)


def chat(d: Deployment, messages: list[dict[str, str]], max_tokens: int = 8,
         headers: dict[str, str] | None = None) -> tuple[dict[str, str], Any]:
    """One chat completion over a new connection (urllib opens one per request)."""
    code, headers, text = post(f"{d.url}/v1/chat/completions",
                               {"model": d.model, "messages": messages, "max_tokens": max_tokens}, headers=headers)
    assert code == 200, (code, text)
    return {k.lower(): v for k, v in headers.items()}, json.loads(text)


def scrape(d: Deployment) -> dict[tuple[str, str], float]:
    """(frontend process, status) -> chat requests, from one scrape of /metrics."""
    out: dict[tuple[str, str], float] = {}
    text = http_text(f"{d.url}/metrics")
    assert re.search(r"^vllm_actors_frontend_scrape_missing 0\.0$", text, re.M), "a frontend process did not answer the scrape"
    for m in re.finditer(r'^vllm_actors_frontend_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("endpoint") == "chat":
            key = (labels["frontend"], labels["status"])
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def served(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], status: str = "200"
           ) -> dict[str, float]:
    return {p: after.get((p, status), 0.0) - before.get((p, status), 0.0) for p in PROCESSES}


def run_sessions(d: Deployment, concurrency: int, session_header: bool) -> list[list[tuple[str, str, int]]]:
    """20 progressive-prefix sessions of 4 turns, each turn over a new connection: per turn, the
    process that served it, the worker, and the cached prompt tokens."""
    run = random.random()

    def session(i: int) -> list[tuple[str, str, int]]:
        msgs = [{"role": "user", "content": f"run {run} session {i}: " + "tell me a long story about the sea " * 4}]
        extra = {"x-dynamo-session-id": f"{run}-{i}"} if session_header else {}
        turns = []
        for turn in range(4):
            headers, body = chat(d, msgs, headers=extra)
            details = body["usage"].get("prompt_tokens_details") or {}
            turns.append((headers[FRONTEND_HEADER], headers[WORKER_HEADER.lower()], details.get("cached_tokens", 0)))
            msgs += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"and then what happened in part {turn}?"}]
        return turns

    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(session, range(20)))


def check_sessions(d: Deployment, sessions: list[list[tuple[str, str, int]]],
                   before: dict[tuple[str, str], float]) -> None:
    stuck = [s for s in sessions if len({w for _, w, _ in s}) == 1 and all(c > 0 for _, _, c in s[1:])]
    assert len(stuck) == 20, [s for s in sessions if s not in stuck]
    # the turns reached both processes (the scrape agrees with the headers), and sessions crossed
    by_process = served(before, scrape(d))
    assert by_process == {p: float(sum(t[0] == p for s in sessions for t in s)) for p in PROCESSES}
    assert all(v > 0 for v in by_process.values()), by_process
    assert sum(len({p for p, _, _ in s}) == 2 for s in sessions) >= 5, sessions


def test_concurrent_sessions_stay_on_their_worker_whichever_process_takes_a_turn(two: Deployment) -> None:
    """20 sessions at once, with Dynamo's session header: the process that routes a session's first
    turn binds it, and its booking carries the binding to the other process. Under this load the
    router alone (KV cost, no binding) moves about one session in twenty to the emptier worker."""
    before = scrape(two)
    check_sessions(two, run_sessions(two, 20, session_header=True), before)


def test_one_scrape_counts_every_request_of_every_process(two: Deployment) -> None:
    before = scrape(two)
    with ThreadPoolExecutor(8) as ex:
        headers = list(ex.map(lambda i: chat(two, [{"role": "user", "content": f"count me {i}"}], 2)[0], range(40)))
    after = scrape(two)
    by_process = served(before, after)
    assert sum(by_process.values()) == 40, by_process
    # each process's series is its own: the counts match the header each response carried
    assert by_process == {p: float(sum(h[FRONTEND_HEADER] == p for h in headers)) for p in PROCESSES}


def test_health_and_models_agree_across_processes(two: Deployment) -> None:
    answers: dict[str, set[str]] = {}
    for _ in range(30):
        for path in ("/health", "/v1/models"):
            with urllib.request.urlopen(f"{two.url}{path}", timeout=5) as r:
                assert r.status == 200
                body = json.loads(r.read())
                if path == "/v1/models":
                    for m in body["data"]:
                        m.pop("created", None)  # the time of the listing
                answers.setdefault(path, set()).add(json.dumps(body, sort_keys=True))
                answers.setdefault("process", set()).add(r.headers[FRONTEND_HEADER])
    assert answers["process"] == set(PROCESSES)
    assert len(answers["/health"]) == 1 and len(answers["/v1/models"]) == 1, answers


def test_a_request_of_death_quarantined_by_one_process_is_refused_by_the_other(two: Deployment) -> None:
    poison = {"model": two.model, "prompt": [5, sc.POISON, 6], "max_tokens": 8}
    code, headers, text = post(f"{two.url}/v1/completions", poison)
    assert code == 500 and "died while serving it" in text, (code, text)
    first = headers.get(FRONTEND_HEADER) or headers.get(FRONTEND_HEADER.title())
    assert first in PROCESSES
    asyncio.run(sc.wait_ready(two.url, 90))
    refused_by: set[str] = set()
    for _ in range(60):  # until the other process has refused it too (new connections land anywhere)
        code, headers, text = post(f"{two.url}/v1/completions", poison)
        assert code == 400 and "quarantined" in text, (code, text)
        refused_by.add({k.lower(): v for k, v in headers.items()}[FRONTEND_HEADER])
        if refused_by == set(PROCESSES):
            break
    assert refused_by == set(PROCESSES), refused_by
    code, _, text = post(f"{two.url}/v1/completions", {"model": two.model, "prompt": "fine", "max_tokens": 4})
    assert code == 200, text


async def _worker_streams(d: Deployment, workers: list[str]) -> dict[str, int]:
    """Each worker's engine requests, running or waiting (its ``stats`` over the bus)."""
    sj = Subjects(d.namespace)
    nc = await nats.connect(d.bus_url)
    try:
        out = {}
        for inst in workers:
            msg = await nc.request(sj.worker(inst, "stats"), b"{}", timeout=5)
            stats = json.loads(msg.data)
            out[inst] = stats["num_running"] + stats["num_waiting"]
        return out
    finally:
        await nc.close()


async def _warm_standby(d: Deployment, timeout: float = 90.0) -> dict[str, dict[str, Any]]:
    """The root's children once its frontend standby is imported and idle (deploy.frontends.Standby):
    a restart then takes it. It is started only once both processes serve, and its imports take
    ~8 s, longer on a loaded machine."""
    end = time.monotonic() + timeout
    while True:
        children = {c["id"]: c for c in await sc.root_children(d.bus_url, d.namespace)}
        status = children.get("frontend-standby", {}).get("status", "")
        if "waiting to be taken" in status:
            return children
        assert time.monotonic() < end, f"no warm frontend standby after {timeout}s: {status!r}"
        await asyncio.sleep(0.2)


async def _kill_under_streams(d: Deployment, victim: str) -> dict[str, Any]:
    body = sc.stream_body(1500)
    children = await _warm_standby(d)
    pid = children[f"frontend-{victim[-1]}"]["pid"]
    workers = d.instances("agg")  # read now: a connection handed to the process as it dies is reset
    started: list[asyncio.Event] = [asyncio.Event() for _ in range(32)]
    outcome: list[dict[str, Any]] = [{} for _ in range(32)]

    async def stream(i: int, s: aiohttp.ClientSession) -> None:
        o = outcome[i]
        try:
            async with s.post(f"{d.url}/v1/completions", json=body) as r:
                o["process"] = r.headers.get(FRONTEND_HEADER)
                o["chunks"], o["done"] = 0, False
                async for line in r.content:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        o["chunks"] += 1
                        started[i].set()
                    elif line.strip() == b"data: [DONE]":
                        o["done"] = True
        except (TimeoutError, aiohttp.ClientError) as e:
            o["error"] = type(e).__name__
        finally:
            started[i].set()

    # a new connection per stream: the kernel spreads them over both processes
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=180)) as s:
        tasks = [asyncio.create_task(stream(i, s)) for i in range(32)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        in_flight_before = sum((await _worker_streams(d, workers)).values())
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        # the killed process's engine requests end: what is left in flight is the survivors' streams
        survivors_running = -1
        left: dict[str, int] = {}
        end = t_kill + 15
        while time.monotonic() < end:
            left = await _worker_streams(d, workers)
            survivors_running = sum(1 for o in outcome if o.get("process") != victim and not o.get("done"))
            if sum(left.values()) == survivors_running:
                break
            await asyncio.sleep(0.2)
        aborted_after = time.monotonic() - t_kill
        in_flight_after_kill = sum(left.values())
        # back and serving: a request answered by the restarted process
        back_after = None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
            while back_after is None and time.monotonic() - t_kill < 30:
                try:
                    async with fresh.get(f"{d.url}/v1/models") as r:
                        if r.status == 200 and r.headers.get(FRONTEND_HEADER) == victim:
                            back_after = time.monotonic() - t_kill
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*tasks), 150)
    idle = {}
    for _ in range(50):
        idle = await _worker_streams(d, workers)
        if not any(idle.values()):
            break
        await asyncio.sleep(0.2)
    after = {c["id"]: c for c in await sc.root_children(d.bus_url, d.namespace)}
    return {"outcome": outcome, "in_flight_before": in_flight_before, "in_flight_after_kill": in_flight_after_kill,
            "survivors_running": survivors_running, "aborted_after_s": aborted_after, "back_after_s": back_after,
            "idle": idle, "old_pid": pid, "children_before": children, "children_after": after}


def test_sigkill_of_a_frontend_process_under_32_streams(two: Deployment) -> None:
    victim = PROCESSES[0]
    r = asyncio.run(_kill_under_streams(two, victim))
    out = r["outcome"]
    print({k: r[k] for k in ("in_flight_before", "in_flight_after_kill", "survivors_running", "aborted_after_s",
                             "back_after_s")})
    on_victim = [o for o in out if o.get("process") == victim]
    on_other = [o for o in out if o.get("process") == PROCESSES[1]]
    assert on_victim and on_other and len(on_victim) + len(on_other) == 32, out
    assert r["in_flight_before"] == 32, r
    # the other process's streams complete; the killed process's connections end without [DONE]
    assert all(o["done"] and "error" not in o for o in on_other), on_other
    assert not any(o.get("done") for o in on_victim), on_victim
    # the killed process's worker requests were aborted while the survivors were still streaming
    assert r["survivors_running"] > 0 and r["in_flight_after_kill"] == r["survivors_running"], r
    assert not any(r["idle"].values()), r  # and once the survivors finished, the engines are idle
    # the root restarted it (and only it) from the warm standby, and it served again within 5 s
    assert r["back_after_s"] is not None and r["back_after_s"] <= 5.0, r
    before, after = r["children_before"], r["children_after"]
    assert after["frontend-0"]["restarts"] == before["frontend-0"]["restarts"] + 1
    assert after["frontend-0"]["pid"] != r["old_pid"]
    assert after["frontend-0"]["pid"] == before["frontend-standby"]["pid"] is not None  # the standby took over
    for cid in after:
        if cid != "frontend-0" and cid != "frontend-standby":
            assert after[cid]["restarts"] == before[cid]["restarts"], (cid, before[cid], after[cid])
    assert two.proc is not None and two.proc.poll() is None


def _respond(d: Deployment, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """One /v1/responses request over a new connection: the process that served it, the response."""
    code, headers, text = post(f"{d.url}/v1/responses", {"model": d.model, "max_output_tokens": 4, **body})
    assert code == 200, (code, text)
    return {k.lower(): v for k, v in headers.items()}[FRONTEND_HEADER], json.loads(text)


def test_a_stored_response_outlives_every_frontend_process(two: Deployment) -> None:
    """A response stored by one process is read and continued by both after both were SIGKILLed and
    restarted: the conversation is in the bus's KV bucket, not in a process."""
    _, first = _respond(two, {"input": "tell me a long story about the sea"})
    assert first["store"] is True
    before = {c["id"]: c for c in asyncio.run(sc.root_children(two.bus_url, two.namespace))}
    for cid in ("frontend-0", "frontend-1"):
        os.kill(before[cid]["pid"], signal.SIGKILL)

    def restarted() -> bool:
        now = {c["id"]: c for c in asyncio.run(sc.root_children(two.bus_url, two.namespace))}
        return all(now[c]["restarts"] > before[c]["restarts"] for c in ("frontend-0", "frontend-1")) and \
            bool(re.search(r"^vllm_actors_frontend_scrape_missing 0\.0$", http_text(f"{two.url}/metrics"), re.M))

    two.wait_until(restarted, 60, "both frontend processes restarted and serving")
    read_by = set()
    for _ in range(4):  # new connections alternate between the two processes
        code, headers, text = get_new(f"{two.url}/v1/responses/{first['id']}")
        assert code == 200 and json.loads(text)["output"] == first["output"], text
        read_by.add(headers[FRONTEND_HEADER])
    assert read_by == set(PROCESSES)
    followed = {}
    for _ in range(2):  # a follow-up from each process
        process, follow = _respond(two, {"input": "and then?", "previous_response_id": first["id"]})
        followed[process] = follow
    _, alone = _respond(two, {"input": "and then?"})
    assert set(followed) == set(PROCESSES)
    for follow in followed.values():
        assert follow["previous_response_id"] == first["id"]
        # the first turn (its input and output) is in the follow-up's prompt
        assert follow["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + first["usage"]["input_tokens"] // 2


def get_new(url: str) -> tuple[int, dict[str, str], str]:
    """A GET over a new connection: status, headers (lower-case), body."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()
