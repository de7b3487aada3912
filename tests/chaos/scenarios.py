"""Fault scenarios against a deployment started with the CLI, as a client sees them.

Each scenario takes a running ``tests.e2e.conftest.Deployment``, does what an operator's bad day
does (SIGKILL the bus or a worker under load, send a request that kills workers, open slow
connections), and returns figures: what every client got (completed, error, hang) and what the
deployment did (restarts, still serving). ``tests/chaos/test_faults.py`` asserts on them;
``bench/reliability.py`` writes them to docs/reliability.md. No pytest here.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import nats

from bus.subjects import Subjects

MODEL = "tiny"
HOST = "local"
POISON = 2047  # the tiny vocabulary's last id: no tokenized prompt of these scenarios holds it
# the deployments the fault scenarios run on (`--set`s of mocker-agg.toml): two replicas, and a
# mocker slow enough that a 300-token stream takes a few seconds, so the faults land mid-stream
PAIR_SETS = ["pools.agg.replicas=2", "pools.agg.engine_args.speedup_ratio=0.5"]
POISON_SETS = ["pools.agg.replicas=2", f"pools.agg.engine_args.poison_token_id={POISON}"]


@dataclass
class StreamOutcome:
    status: int = 0
    outcome: str = "hang"  # completed | error | hang
    chunks: int = 0
    text: str = ""
    error: str | None = None
    max_silence: float = 0.0  # longest wait for the next byte (s)
    seconds: float = 0.0


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      hang_after: float) -> StreamOutcome:
    """One streamed completion; a silence longer than ``hang_after`` counts as a hang."""
    out = StreamOutcome()
    t0 = last = time.monotonic()
    finished = False
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status
            last = time.monotonic()
            out.max_silence = last - t0
            if resp.status != 200:
                out.outcome, out.error = "error", (await resp.text())[:300]
                return out
            while True:
                line = await asyncio.wait_for(resp.content.readline(), hang_after)
                now = time.monotonic()
                out.max_silence = max(out.max_silence, now - last)
                last = now
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    out.outcome = "error" if out.error or not finished else "completed"
                    if not finished and not out.error:
                        out.error = "[DONE] without a finish_reason"
                    return out
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"].get("message", "")[:300]
                    continue
                for c in event.get("choices", []):
                    out.chunks += 1
                    out.text += c.get("text") or ""
                    finished = finished or c.get("finish_reason") is not None
            out.outcome, out.error = "error", out.error or "connection closed before [DONE]"
    except TimeoutError:
        out.outcome, out.error = "hang", f"no byte for {hang_after:g}s"
        out.max_silence = max(out.max_silence, time.monotonic() - last)
    except aiohttp.ClientError as e:
        out.outcome, out.error = "error", f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - t0
    return out


def summarize(outcomes: list[StreamOutcome], reference: str | None = None) -> dict[str, Any]:
    """Counts by outcome; ``exact``: completed streams whose text equals a fault-free run's (no token
    lost or repeated across a re-send)."""
    counts = {k: sum(o.outcome == k for o in outcomes) for k in ("completed", "error", "hang")}
    summary: dict[str, Any] = {"streams": len(outcomes), **counts,
                               "max_silence_s": round(max((o.max_silence for o in outcomes), default=0.0), 2),
                               "errors": sorted({o.error for o in outcomes if o.error})[:5]}
    if reference is not None:
        summary["exact"] = sum(o.outcome == "completed" and o.text == reference for o in outcomes)
    return summary


# --- the deployment's own view --------------------------------------------------------------------
async def root_children(bus_url: str, namespace: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The root supervisor's ``children`` view (pid, restarts, state of each child)."""
    nc = await nats.connect(bus_url, max_reconnect_attempts=3, connect_timeout=2)
    try:
        msg = await nc.request(Subjects(namespace).supervisor(HOST, "children"), b"{}", timeout=timeout)
        return json.loads(msg.data)["children"]
    finally:
        await nc.close()


async def children_when_up(bus_url: str, namespace: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """``root_children`` once the bus answers again (after a bus restart)."""
    end = time.monotonic() + timeout
    while True:
        try:
            return await root_children(bus_url, namespace)
        except Exception:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.5)


def restarts(children: list[dict[str, Any]], prefix: str = "worker-") -> int:
    return sum(c["restarts"] for c in children if c["id"].startswith(prefix))


def pid_of(children: list[dict[str, Any]], child_id: str) -> int:
    for c in children:
        if c["id"] == child_id and c.get("pid"):
            return int(c["pid"])
    raise LookupError(f"no running child {child_id}: {[c['id'] for c in children]}")


async def wait_ready(url: str, timeout: float = 60.0) -> float:
    """Seconds until /health says 200 again."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout:
            try:
                async with s.get(f"{url}/health") as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout}s")


def stream_body(max_tokens: int, seed: int = 7) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "the bus goes down", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "seed": seed, "ignore_eos": True}


async def _reference(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    out = await read_stream(session, url, body, 60)
    assert out.outcome == "completed", out
    return out.text


# --- scenarios ------------------------------------------------------------------------------------
async def bus_kill_under_streams(d: Any, *, streams: int = 16, max_tokens: int = 300,
                                 kill_after: float = 1.5, late: int = 4, stall_timeout: float = 10.0
                                 ) -> dict[str, Any]:
    """SIGKILL the embedded nats-server while ``streams`` streams run; ``late`` more requests are sent
    0.2 s after the kill, while the bus is down. Every stream must complete or end with an error;
    none may hang (silence longer than the stall timeout + 5 s)."""
    hang_after = stall_timeout + 5.0
    body = stream_body(max_tokens)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        reference = await _reference(s, d.url, body)
        before = await root_children(d.bus_url, d.namespace)
        tasks = [asyncio.create_task(read_stream(s, d.url, body, hang_after)) for _ in range(streams)]
        await asyncio.sleep(kill_after)
        os.kill(pid_of(before, "nats"), signal.SIGKILL)
        await asyncio.sleep(0.2)
        late_tasks = [asyncio.create_task(read_stream(s, d.url, body, hang_after)) for _ in range(late)]
        in_flight = await asyncio.gather(*tasks)
        after_kill = await asyncio.gather(*late_tasks)
        after = await children_when_up(d.bus_url, d.namespace)
    return {"in_flight": summarize(in_flight, reference), "sent_while_down": summarize(after_kill, reference),
            "worker_restarts": restarts(after) - restarts(before),
            "nats_restarted": pid_of(after, "nats") != pid_of(before, "nats")}


async def requests_as_the_bus_restarts(d: Any, *, requests: int = 4, rounds: int = 1,
                                       answer_within: float = 15.0) -> dict[str, Any]:
    """SIGKILL the embedded nats-server and, at once, send ``requests`` requests together (plain
    completions); ``rounds`` times, each once the deployment is ready again. Every request must be
    answered within ``answer_within`` seconds: 200, or 503 with Retry-After. A request sent into
    the outage may be lost with the frontend's connection; it must be sent again to the live worker
    (with one worker, there is no other to wait for)."""
    body = {"model": MODEL, "prompt": "sent as the bus restarts", "max_tokens": 8}
    answers: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=answer_within + 60)) as s:

        async def one(rnd: int) -> dict[str, Any]:
            t0 = time.monotonic()
            try:
                async with s.post(f"{d.url}/v1/completions", json=body) as r:
                    await r.read()
                    return {"round": rnd, "status": r.status, "retry_after": r.headers.get("Retry-After"),
                            "seconds": round(time.monotonic() - t0, 2)}
            except (aiohttp.ClientError, TimeoutError) as e:
                return {"round": rnd, "status": None, "error": f"{type(e).__name__}: {e}",
                        "seconds": round(time.monotonic() - t0, 2)}

        before = await root_children(d.bus_url, d.namespace)
        for rnd in range(rounds):
            children = await children_when_up(d.bus_url, d.namespace)
            os.kill(pid_of(children, "nats"), signal.SIGKILL)
            answers += await asyncio.gather(*(one(rnd) for _ in range(requests)))
            await wait_ready(d.url, 60)
        after = await children_when_up(d.bus_url, d.namespace)
    ok = [a for a in answers if a["seconds"] <= answer_within
          and (a["status"] == 200 or (a["status"] == 503 and a["retry_after"]))]
    return {"requests": len(answers), "answered_in_time": len(ok),
            "statuses": sorted({str(a["status"]) for a in answers}),
            "max_seconds": max(a["seconds"] for a in answers),
            "seconds": sorted(a["seconds"] for a in answers),
            "late_or_bad": [a for a in answers if a not in ok][:5],
            "worker_restarts": restarts(after) - restarts(before)}


async def worker_kill_under_streams(d: Any, *, streams: int = 32, max_tokens: int = 300,
                                    kill_after: float = 1.5, victim: str = "worker-agg-0",
                                    stall_timeout: float = 10.0) -> dict[str, Any]:
    """SIGKILL one worker process while ``streams`` streams run over the pool."""
    body = stream_body(max_tokens, seed=11)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        reference = await _reference(s, d.url, body)
        before = await root_children(d.bus_url, d.namespace)
        tasks = [asyncio.create_task(read_stream(s, d.url, body, stall_timeout + 5.0)) for _ in range(streams)]
        await asyncio.sleep(kill_after)
        os.kill(pid_of(before, victim), signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks)
        ready_after = await wait_ready(d.url)
        after = await root_children(d.bus_url, d.namespace)
    return {"streams": summarize(outcomes, reference), "worker_restarts": restarts(after) - restarts(before),
            "ready_again_after_s": round(ready_after, 2)}


async def request_of_death(d: Any, *, poison: list[int], others: int = 8) -> dict[str, Any]:
    """A request that kills every worker it reaches (the mocker's ``poison_token_id``), sent twice,
    with ``others`` ordinary requests (distinct prompts) around it. The first must fail with a 500
    after at most 2 worker deaths, the second be refused with a 4xx without reaching a worker; the
    deployment keeps serving. The ordinary requests must all be served: those on a worker the
    poison killed are suspects with it, and go to their next worker one at a time
    (``actors.frontend.suspects``), so none shares its second worker with the poison. One that
    failed anyway (a bystander) is counted, with its error."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        before = await root_children(d.bus_url, d.namespace)

        async def post(body: dict[str, Any]) -> tuple[int, Any]:
            async with s.post(f"{d.url}/v1/completions", json=body) as r:
                return r.status, await r.json(content_type=None)

        def ordinary(i: int | str) -> dict[str, Any]:
            return {"model": MODEL, "prompt": f"an ordinary request number {i}", "max_tokens": 8}

        bad = {"model": MODEL, "prompt": poison, "max_tokens": 8}
        first, *around = await asyncio.gather(post(bad), *(post(ordinary(i)) for i in range(others)))
        second = await post(bad)
        await wait_ready(d.url, 90)
        served_after = await post(ordinary("after"))
        after = await root_children(d.bus_url, d.namespace)
    bystanders = [body.get("error", {}).get("message", "") for code, body in around if code != 200]
    return {"first": {"status": first[0], "error": first[1].get("error", {}).get("message")},
            "again": {"status": second[0], "error": second[1].get("error", {}).get("message")},
            "ordinary_statuses": sorted(code for code, _ in around),
            "bystanders_failed": len(bystanders),
            "bystander_errors": bystanders[:3],
            "served_after": served_after[0],
            "worker_restarts": restarts(after) - restarts(before),
            "deployment_running": d.proc.poll() is None}


async def slow_clients(d: Any, *, connections: int = 500, header_timeout: float = 10.0,
                       line_every: float = 5.0) -> dict[str, Any]:
    """``connections`` raw TCP clients: half send nothing, half send one header line every
    ``line_every`` seconds (slowloris). Measures when the server closes each, and whether an ordinary
    request is served meanwhile."""
    host, port = "127.0.0.1", d.http_port
    loop = asyncio.get_running_loop()

    async def one(i: int) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            return {"closed_after": 0.0, "status": None, "refused": str(e)}
        head = b""
        try:
            if i % 2:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(4096), line_every)
                except TimeoutError:
                    if time.monotonic() - t0 > header_timeout * 3:
                        return {"closed_after": None, "status": None}  # never closed
                    if i % 2:
                        writer.write(f"X-Slow-{int(time.monotonic() - t0)}: 1\r\n".encode())
                    continue
                if not data:
                    break
                head += data
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.") else None
        body_ok = None
        if b"\r\n\r\n" in head:
            try:
                err = json.loads(head.split(b"\r\n\r\n", 1)[1])["error"]
                body_ok = isinstance(err["message"], str) and isinstance(err["type"], str)
            except (ValueError, KeyError, TypeError):
                body_ok = False
        return {"closed_after": time.monotonic() - t0, "status": status, "openai_body": body_ok}

    attack = [loop.create_task(one(i)) for i in range(connections)]
    await asyncio.sleep(1.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(f"{d.url}/v1/completions",
                          json={"model": MODEL, "prompt": "meanwhile", "max_tokens": 4}) as r:
            served_meanwhile = r.status
    results = await asyncio.gather(*attack)
    closed = [r["closed_after"] for r in results if r["closed_after"] is not None]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {"connections": connections, "closed": len(closed), "never_closed": connections - len(closed),
            "max_closed_after_s": round(max(closed, default=0.0), 2),
            "statuses": statuses,
            "non_openai_bodies": sum(r.get("openai_body") is False for r in results),
            "served_meanwhile": served_meanwhile}


def raise_nofile(want: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


