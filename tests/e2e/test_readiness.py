"""Readiness tells the truth, as a user meets it: deployments started with the CLI at their default
namespace and run dir (HOME is a tmp dir, so nothing touches the real ~/.cache), one after another
on the same ports, restarted after a SIGKILL of every process, and scaled down under load.

The first moment ``/health`` is 200 or ``/v1/models`` lists the model, 8 requests sent at once all
succeed (``Deployment.wait_first_ready``); before that, ``/health`` is 503 with a per-pool body and
requests get 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import psutil
import pytest

from bus import rpc
from bus.subjects import Subjects
from tests.e2e.conftest import WORKER_HEADER, Deployment, shutdown
from tests.helpers import registry

NS = "dynamo"  # the shipped topologies' namespace: what two users on one host both get


def default_deployment(tmp: Path, topology: str, env: dict[str, str], *, bus_port: int | None = None,
                       http_port: int | None = None, sets: list[str] | None = None) -> Deployment:
    """A deployment with the topology's own namespace and the default run dir; only the ports are
    chosen (free ones, or those given: a restart on the same ports)."""
    tmp.mkdir(exist_ok=True)
    d = Deployment(topology, tmp, NS, env=env, sets=sets)
    for key in ("namespace", "run_dir"):
        i = next(i for i, a in enumerate(d.args) if a.startswith(f"{key}="))
        del d.args[i - 1:i + 1]
    if bus_port is not None:
        d.args[d.args.index(f"bus.port={d.bus_port}")] = f"bus.port={bus_port}"
        d.bus_port = bus_port
    if http_port is not None:
        d.args[d.args.index(f"frontend.http=127.0.0.1:{d.http_port}")] = f"frontend.http=127.0.0.1:{http_port}"
        d.http_port = http_port
    return d


@pytest.fixture
def started() -> Iterator[list[Deployment]]:
    ds: list[Deployment] = []
    yield ds
    for d in reversed(ds):
        if d.proc is not None:
            d.stop(30 if d.proc.poll() is None else 1)


def live_instances(d: Deployment) -> set[str]:
    status, body = d.health()
    assert status == 200, body
    return {i["instance"] for i in body["instances"]}


async def registry_instances(d: Deployment) -> set[str]:
    """Worker instances whose engine answers on the bus right now."""
    nc = await nats.connect(d.bus_url)
    try:
        records = await registry(nc, NS)
        alive = set()
        for k in records:
            try:
                await rpc.request(nc, Subjects(NS).worker(k, "stats"), {}, timeout=2)
                alive.add(k)
            except Exception:  # noqa: BLE001 - not an engine, or a ghost
                pass
        return alive
    finally:
        await nc.close()


def test_back_to_back_deployments_never_see_the_previous_one(tmp_path: Path, home: dict[str, str],
                                                            started: list[Deployment]) -> None:
    """disagg, stopped, then agg on the same ports and store: the old model cards and instances never
    reach the new frontend (the first requests succeed, /health lists only the new workers)."""
    first = default_deployment(tmp_path / "disagg", "mocker-disagg.toml", home)
    started.append(first)
    first.start()
    first.wait_first_ready(60)
    first.wait_ready({"prefill": 1, "decode": 2}, 60)
    old = live_instances(first)
    shutdown(first)

    second = default_deployment(tmp_path / "agg", "mocker-agg.toml", home, bus_port=first.bus_port,
                                http_port=first.http_port)
    started.append(second)
    second.start()
    seen = second.wait_first_ready(60)
    assert all(code == 200 for code, _ in seen["results"])
    now = live_instances(second)
    assert now and not (now & old)
    _, body = second.health()
    assert set(body["pools"]) == {"agg"} and {i["pool"] for i in body["instances"]} == {"agg"}
    shutdown(second)


def test_sigkill_of_a_whole_deployment_then_a_fresh_start(tmp_path: Path, home: dict[str, str],
                                                          started: list[Deployment]) -> None:
    """Every process SIGKILLed at once (no deregistration, records left in the store), then the same
    deployment started again: ghosts are never routed to, and /health lists only live instances."""
    sets = ["pools.agg.replicas=2"]
    first = default_deployment(tmp_path / "one", "mocker-agg.toml", home, sets=sets)
    started.append(first)
    first.start()
    first.wait_ready({"agg": 2}, 60)
    old = live_instances(first)
    assert first.proc is not None
    procs = [psutil.Process(first.proc.pid), *psutil.Process(first.proc.pid).children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)
    first.proc.wait()

    second = default_deployment(tmp_path / "two", "mocker-agg.toml", home, bus_port=first.bus_port,
                                http_port=first.http_port, sets=sets)
    started.append(second)
    second.start()
    second.wait_first_ready(60)
    second.wait_ready({"agg": 2}, 60)
    now = live_instances(second)
    assert len(now) == 2 and not (now & old)
    assert asyncio.run(registry_instances(second)) >= now
    shutdown(second)


def progressive_sessions(url: str, sessions: int, turns: int) -> list[list[str]]:
    """``sessions`` conversations of ``turns`` requests, each prompt extending the previous one by
    the previous answer and a new question (as a chat client does); the worker of each turn."""

    async def one(client: httpx.AsyncClient, s: int) -> list[str]:
        prompt = f"session {s}: " + " ".join(f"fact {s}.{i} is that stones are heavy;" for i in range(40))
        seen = []
        for t in range(turns):
            r = await client.post(f"{url}/v1/completions",
                                  json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            seen.append(r.headers[WORKER_HEADER])
            prompt += r.json()["choices"][0]["text"] + f" question {t}: why?"
        return seen

    async def run() -> list[list[str]]:
        # one session after another: with several at once the cost function may rightly move a
        # turn off a worker busy with another session; stickiness is about what the router knows
        async with httpx.AsyncClient(timeout=60) as client:
            return [await one(client, s) for s in range(sessions)]

    return asyncio.run(run())


def test_kv_sessions_started_the_moment_the_model_is_listed_stay_on_one_worker(
        tmp_path: Path, home: dict[str, str], started: list[Deployment]) -> None:
    d = default_deployment(tmp_path / "kv", "mocker-kv.toml", home)
    d.args += ["--log-level", "DEBUG"]  # the router's decisions, with every worker's cost, in the log
    started.append(d)
    d.start()
    d.wait_first_ready(60)  # the moment the model is listed: 8 requests at once, then the sessions
    workers = progressive_sessions(d.url, sessions=8, turns=4)
    split = [w for w in workers if len(set(w)) > 1]
    if split:  # say why: the decisions of the sessions' requests (completions) and the feed's news
        why = [ln for ln in d.log.read_text().splitlines()
               if "route cmpl-" in ln or "KV feed" in ln or "session" in ln]
        pytest.fail(f"sessions split over workers: {split}\n" + "\n".join(why)[-20000:])
    shutdown(d)


def test_scale_down_under_streams_loses_nothing(tmp_path: Path, home: dict[str, str],
                                                started: list[Deployment]) -> None:
    """16 streams running over two workers; one worker is stopped through the root supervisor's
    ``stop`` verb: it leaves the registry, drains, then stops: 0 failed streams, nothing is routed to
    it afterwards, /health stays 200 and says the replica is stopped."""
    d = default_deployment(tmp_path / "scale", "mocker-agg.toml", home,
                           sets=["pools.agg.replicas=2", "pools.agg.engine_args.speedup_ratio=1.0"])
    started.append(d)
    d.start()
    d.wait_ready({"agg": 2}, 60)

    async def stream(client: httpx.AsyncClient, i: int) -> tuple[int, int, str | None, str]:
        body = {"model": "tiny", "prompt": f"stream {i} tells a long story", "max_tokens": 120,
                "stream": True, "ignore_eos": True, "temperature": 0}
        tokens, finish, worker = 0, None, ""
        async with client.stream("POST", f"{d.url}/v1/completions", json=body) as r:
            worker = r.headers.get(WORKER_HEADER, "")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return r.status_code, tokens, "error", worker
                    for ch in chunk["choices"]:
                        tokens += 1 if ch["text"] else 0
                        finish = ch["finish_reason"] or finish
            return r.status_code, tokens, finish, worker

    async def run() -> tuple[list[Any], str, list[str]]:
        nc = await nats.connect(d.bus_url)
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = [asyncio.create_task(stream(client, i)) for i in range(16)]
                await asyncio.sleep(1.0)  # all streams under way
                children = await rpc.request(nc, Subjects(NS).supervisor("local", "children"), {}, timeout=5)
                victim = next(c for c in children["children"] if c["id"] == "worker-agg-1")
                reply = await rpc.request(nc, Subjects(NS).supervisor("local", "stop"), {"id": "worker-agg-1"},
                                          timeout=60)
                results = await asyncio.gather(*tasks)
                after = []
                for i in range(8):
                    r = await client.post(f"{d.url}/v1/completions",
                                          json={"model": "tiny", "prompt": f"after {i}", "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    after.append(r.headers[WORKER_HEADER])
                return results, str(victim["pid"]) + str(reply), after
        finally:
            await nc.close()

    results, _, after = asyncio.run(run())
    failed = [r for r in results if r[0] != 200 or r[2] != "length" or r[1] < 100]
    assert not failed, f"{len(failed)} of 16 streams failed: {failed}\n{d.output(3000)}"
    assert len({r[3] for r in results}) == 2  # the streams really ran on both workers
    status, body = d.health()
    assert status == 200, body
    (remaining,) = {i["instance"] for i in body["instances"]}
    assert set(after) == {remaining}
    missing = body["pools"]["agg"]["missing"]
    assert [(m["child"], m["state"]) for m in missing] == [("worker-agg-1", "stopped")], body
    shutdown(d)


def test_health_body_while_starting_names_each_pool(tmp_path: Path, home: dict[str, str],
                                                   started: list[Deployment]) -> None:
    """Before the deployment can serve: 503, a JSON body with each pool's ready/expected replicas and
    what each missing one is doing; requests meanwhile are 503 with Retry-After."""
    d = default_deployment(tmp_path / "body", "mocker-disagg.toml", home)
    started.append(d)
    d.start()
    bodies: list[dict[str, Any]] = []
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            status, body = d.health()
        except OSError:
            time.sleep(0.02)
            continue
        if status == 200:
            break
        bodies.append(body)
        time.sleep(0.02)
    assert bodies, "never saw /health before the deployment was ready"
    for b in bodies:
        assert b["status"] == "starting" and set(b["pools"]) == {"prefill", "decode"}, b
        for name, p in b["pools"].items():
            assert p["expected"] == (2 if name == "decode" else 1)
            assert p["ready"] + len(p["missing"]) >= p["expected"] or p["missing"], b
            for m in p["missing"]:
                assert m["state"] in ("starting", "loading", "registering", "restarting", "unknown"), m
    assert any(m["state"] in ("starting", "loading", "registering") for b in bodies
               for p in b["pools"].values() for m in p["missing"])
    shutdown(d)



def test_a_frontend_restarted_after_a_shrink_is_ready_with_the_replicas_that_run(
        tmp_path: Path, home: dict[str, str], started: list[Deployment]) -> None:
    """Two replicas by the topology; one removed as the planner removes one (the root's ``stop`` with
    ``"remove": true``); then the frontend restarts (the root's ``restart`` of ``inproc``, the
    supervisor of the in-process actors, frontend first). The new frontend is ready at one replica:
    200 and served, not 503 "starting" waiting for the removed one."""
    d = default_deployment(tmp_path / "shrunk", "mocker-agg.toml", home, sets=["pools.agg.replicas=2"])
    started.append(d)
    d.start()
    d.wait_ready({"agg": 2}, 60)

    async def shrink_then_restart_frontend() -> dict[str, Any]:
        nc = await nats.connect(d.bus_url)
        try:
            subjects = Subjects(NS)
            await rpc.request(nc, subjects.supervisor("local", "stop"), {"id": "worker-agg-1", "remove": True},
                              timeout=60)
            return await rpc.request(nc, subjects.supervisor("local", "restart"), {"id": "inproc"},
                                     timeout=60)
        finally:
            await nc.close()

    # answered at once though the request did not say "wait": false: the restart takes the root's
    # control service (which answers) down with the rest of the in-process actors
    reply = asyncio.run(shrink_then_restart_frontend())
    assert reply["status"] == "accepted", reply
    time.sleep(1.0)  # the old frontend is gone (its /health would answer 200)
    end = time.monotonic() + 30
    status, body = 0, {}
    while time.monotonic() < end:
        try:
            status, body = d.health()
        except OSError:  # the new frontend is not listening yet
            status = 0
        if status == 200:
            break
        time.sleep(0.2)
    assert status == 200 and body["status"] == "healthy", body
    agg = body["pools"]["agg"]
    assert (agg["ready"], agg["expected"], agg["minimum"], agg["missing"]) == (1, 1, 1, []), body
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200, r.text
    shutdown(d)
