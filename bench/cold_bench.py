"""Wake latency: how long the first request for a cold model waits for its first token.

For each engine (the mocker at zero compute, vLLM-CPU with the tiny model) it starts deployments
with ``python -m actors.supervisor`` and, ``--repeats`` times each, lets the pool go cold and sends
one streamed request:

- ``warm``: the worker awake (the baseline a cold start adds to);
- ``sleep L1`` / ``sleep L2``: the worker auto-slept (``sleep.idle_timeout``), at level 1, or
  deepened to level 2 (``sleep.deeper_after``);
- ``zero``: the pool at zero replicas (``sleep.idle_stop``): a worker process and its engine start.

It reports the client's time to first token and the waker's own time for the action (the
``seconds`` of its ``WakeOutcome`` on ``<ns>.wake.outcome``: the wake_up verb's answer, or the
spawn until the worker is ready), medians over the repeats.

    python -m bench.cold_bench --engine mocker --engine vllm --repeats 3 --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import nats

from bench.deployment import Deployment
from bench.docs_section import write_section

TOPOLOGY = {"mocker": "topologies/mocker-agg.toml", "vllm": "topologies/agg.toml"}
START_TIMEOUT = {"mocker": 60.0, "vllm": 300.0}
SECTION = "Scale to zero: wake latency"


async def ttft(session: aiohttp.ClientSession, url: str) -> float:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    first = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
                first = time.monotonic() - t0
    if first is None:
        raise RuntimeError("no token")
    return first


async def cold(session: aiohttp.ClientSession, url: str, want: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        async with session.get(url + "/health") as r:
            body = await r.json()
        if body.get("status") == "cold" and want in (body.get("cold") or {}).get("pools", {}).values():
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"never cold ({want}) in {timeout}s")


async def serving(session: aiohttp.ClientSession, url: str, timeout: float) -> None:
    """Until /health is 200: healthy, or already cold (an engine that slept before we looked)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"not serving after {timeout}s")


async def no_replica(nc: nats.NATS, ns: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        msg = await nc.request(f"{ns}.supervisor.local.children", b"{}", timeout=5)
        if not [c for c in json.loads(msg.data)["children"] if (c.get("meta") or {}).get("pool") == "agg"]:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("replica never removed")


async def run(engine: str, scenario: str, repeats: int) -> dict[str, Any]:
    sets = {"sleep": ["pools.agg.sleep.idle_timeout=1", "pools.agg.sleep.deeper_after=2"],
            "zero": ["pools.agg.sleep.idle_stop=2"]}[scenario]
    d = Deployment(TOPOLOGY[engine], "round_robin", f"cold{engine[:1]}{scenario[:1]}")
    for s in [*sets, "frontend.cold.wake_timeout=300", "pools.agg.status_port=0"]:
        d.cmd += ["--set", s]
    d.start()
    out: dict[str, list[float]] = {}
    outcomes: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await serving(session, d.url, START_TIMEOUT[engine])
            nc = await nats.connect(f"nats://127.0.0.1:{d.bus_port}")

            async def seen(msg: Any) -> None:
                outcomes.append(json.loads(msg.data))

            await nc.subscribe(f"{d.ns}.wake.outcome", cb=seen)
            try:
                for _ in range(repeats):
                    if scenario == "sleep":
                        await ttft(session, d.url)  # awake now (it may have slept already)
                        out.setdefault("warm", []).append(await ttft(session, d.url))
                        for level in (1, 2):
                            await cold(session, d.url, "sleep", 60)
                            if level == 2:
                                await asyncio.sleep(2.5)  # deeper_after: level 2
                            n = len(outcomes)
                            out.setdefault(f"sleep L{level}", []).append(await ttft(session, d.url))
                            await asyncio.sleep(0.2)
                            out.setdefault(f"sleep L{level} waker", []).append(
                                next(o["seconds"] for o in outcomes[n:] if o["action"] == "wake"))
                    else:
                        await cold(session, d.url, "zero", 120)
                        await no_replica(nc, d.ns, 120)
                        n = len(outcomes)
                        out.setdefault("zero", []).append(await ttft(session, d.url))
                        await asyncio.sleep(0.2)
                        out.setdefault("zero waker", []).append(
                            next(o["seconds"] for o in outcomes[n:] if o["action"] == "spawn"))
            finally:
                await nc.drain()
    finally:
        d.stop()
    return {k: statistics.median(v) for k, v in out.items()} | {"n": repeats}


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| engine | cold state | first token (client) | waker's action | warm first token |",
            "|---|---|---|---|---|"]
    for engine, r in results.items():
        warm = f"{r['warm'] * 1000:.0f} ms"
        for state, key, action in (("asleep, level 1", "sleep L1", "wake_up"),
                                   ("asleep, level 2", "sleep L2", "wake_up"),
                                   ("zero replicas", "zero", "spawn until ready")):
            rows.append(f"| {engine} | {state} | {r[key] * 1000:.0f} ms | {r[key + ' waker'] * 1000:.0f} ms "
                        f"({action}) | {warm} |")
    return "\n".join(rows)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", choices=sorted(TOPOLOGY))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", type=Path, help="write the section into this markdown file")
    a = p.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for engine in a.engine or ["mocker"]:
        r = await run(engine, "sleep", a.repeats)
        r.update(await run(engine, "zero", a.repeats))
        results[engine] = r
        print(engine, json.dumps(r, indent=1), flush=True)
    text = table(results)
    print(text)
    if a.write:
        cmd = "python -m bench.cold_bench " + " ".join(f"--engine {e}" for e in results) + f" --repeats {a.repeats}"
        write_section(a.write, SECTION, f"`{cmd}` (medians of {a.repeats}; one streamed request of 8 tokens "
                      "after the pool went cold by itself; this 2-core box)\n\n" + text,
                      reading="What it says:")


if __name__ == "__main__":
    asyncio.run(main())
