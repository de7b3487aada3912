"""One deployment over several namespace "hosts", started as an operator starts it on real hosts:
one topology file, one ``python -m actors.supervisor TOPOLOGY --host NAME`` per host (the cluster's
addresses and this run's namespace, ports and run dir given with ``--set``), and a client that
talks to the frontend from inside host a (its 127.0.0.1 is host a's own).

``Stream`` and ``chat`` are what a client sees: the status, the instance headers, every SSE event,
whether the stream ended with ``[DONE]``, and the usage it reported.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
import nats.js.errors

from tests.helpers import registry
from tests.multihost.netns import Hosts, NetnsLoop

ROOT = Path(__file__).resolve().parents[2]
WORKER_HEADER = "x-worker-instance-id"
PREFILL_HEADER = "x-prefill-instance-id"
HTTP_PORT = 8000  # every host has its own loopback: the topology's defaults need no change
BUS_PORT = 4222


@dataclass
class Stream:
    """One streamed chat completion as the client saw it."""

    status: int = 0
    worker: str | None = None
    prefill: str | None = None
    tokens: int = 0  # content deltas received
    done: bool = False  # the stream ended with data: [DONE]
    errors: list[Any] = field(default_factory=list)  # error events, or the error body of a non-200
    usage: dict[str, Any] | None = None
    text: str = ""
    tokens_at_action: int | None = None  # tokens received when chats_during's action ran

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.errors


async def chat(session: aiohttp.ClientSession, max_tokens: int, prompt: str, *,
               stream: bool = True, timeout: float = 120.0, out: Stream | None = None) -> Stream:
    """A chat completion on host a's frontend (run it on a loop of host a); ``out`` fills as the
    stream goes, for a caller that watches its progress."""
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = out if out is not None else Stream()
    async with session.post(f"http://127.0.0.1:{HTTP_PORT}/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        out.status, out.worker, out.prefill = r.status, r.headers.get(WORKER_HEADER), r.headers.get(PREFILL_HEADER)
        if r.status != 200 or not stream:
            data = await r.json(content_type=None)
            if r.status != 200:
                out.errors.append(data)
            else:
                out.done, out.usage = True, data.get("usage")
                out.text = data["choices"][0]["message"]["content"] or ""
                out.tokens = out.usage["completion_tokens"] if out.usage else 0
            return out
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                out.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                out.errors.append(event["error"])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    out.tokens += 1
                    out.text += piece
            if event.get("usage"):
                out.usage = event["usage"]
    return out


async def health(session: aiohttp.ClientSession) -> tuple[int, dict[str, Any]]:
    async with session.get(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, await r.json(content_type=None)


class HostsDeployment:
    """A topology's hosts, each a supervisor process in its own namespace."""

    def __init__(self, hosts: Hosts, topology: str | Path, tmp: Path, sets: list[str] | None = None,
                 env: dict[str, str] | None = None, *, cluster: bool = True) -> None:
        self.hosts = hosts
        self.topology = str(topology)
        self.tmp = tmp
        self.namespace = f"mh{secrets.token_hex(3)}"
        servers = ", ".join(f'{h.name} = "{h.address}"' for h in hosts)
        # the cluster's addresses are this run's namespaces' (cluster=False: a one-host deployment)
        self.sets = [f"namespace={self.namespace}", f"run_dir={tmp / 'run'}",
                     *([f"bus.cluster.servers={{ {servers} }}"] if cluster else []), *(sets or [])]
        # run state in this run's run_dir (set above); the machine's built tiny model is shared
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.loops: dict[str, NetnsLoop] = {}
        self.starts: dict[str, int] = {}

    def start(self, name: str, host: str | None = None) -> subprocess.Popen[Any]:
        """Start host ``name``'s supervisor (again), logging to ``<tmp>/<name>-<n>.log``; ``host``:
        the topology's name for it, when that is not the namespace's (a one-host topology's "local")."""
        n = self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.tmp / f"{name}-{n}.log", "w")  # noqa: SIM115 - the process writes it
        argv = [sys.executable, "-m", "actors.supervisor", self.topology, "--host", host or name,
                "--log-level", "INFO"]
        for s in self.sets:
            argv += ["--set", s]
        p = self.hosts[name].popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
        log.close()
        self.procs[name] = p
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal host ``name``'s supervisor's whole process group and wait for the supervisor."""
        p = self.procs[name]
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        p.wait(60)

    def loop(self, name: str = "a") -> NetnsLoop:
        """A client loop inside host ``name`` (one per host, made on first use)."""
        if name not in self.loops:
            self.loops[name] = self.hosts[name].loop()
        return self.loops[name]

    def logs(self) -> str:
        """Every host's log, the tail of each (for assertion messages)."""
        out = []
        for path in sorted(self.tmp.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            out.append(f"--- {path.name} ---\n" + "\n".join(lines[-40:]))
        return "\n".join(out)

    def stop(self) -> None:
        """SIGTERM every supervisor, then SIGKILL what is left in the namespaces."""
        for loop in self.loops.values():
            loop.close()
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                pass
        for h in self.hosts:
            h.kill_all()

    # --- what host a's client sees --------------------------------------------------------------

    def wait_ready(self, ready: dict[str, int], timeout: float = 120.0) -> dict[str, Any]:
        """Wait until /health is 200 with at least ``ready[pool]`` ready workers per pool."""

        async def poll() -> dict[str, Any]:
            body: dict[str, Any] = {}
            async with aiohttp.ClientSession() as s:
                end = time.monotonic() + timeout
                while time.monotonic() < end:
                    try:
                        status, body = await health(s)
                        pools = body.get("pools", {})
                        if status == 200 and all(pools.get(p, {}).get("ready", 0) >= n for p, n in ready.items()):
                            return body
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        pass
                    await asyncio.sleep(0.5)
            raise AssertionError(f"not ready with {ready} within {timeout:g}s: {body}\n{self.logs()}")

        return self.loop().run(poll(), timeout=timeout + 10)

    def hosts_of(self) -> dict[str, str]:
        """instance -> host, from the registry as host a's server has it."""

        async def read() -> dict[str, str]:
            nc = await nats.connect(f"nats://127.0.0.1:{BUS_PORT}")
            try:
                for _ in range(40):
                    try:
                        return {k: v["host"] for k, v in (await registry(nc, self.namespace)).items()}
                    except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
                        # a host rejoining the cluster can move JetStream's meta leader: for a few
                        # seconds a reader (`nats kv ls` too) is told to come back, and does
                        await asyncio.sleep(0.5)
                raise AssertionError("JetStream stayed unavailable for 20 s")
            finally:
                await nc.close()

        return self.loop().run(read())

    def chats(self, n: int, max_tokens: int, *, prompt: str = "multi-host", stream: bool = True,
              timeout: float = 120.0) -> list[Stream]:
        """``n`` concurrent chats with distinct prompts, all the client saw of each."""

        async def many() -> list[Stream]:
            async with aiohttp.ClientSession() as s:
                return list(await asyncio.gather(*(chat(s, max_tokens, f"{prompt} {i} " * 8, stream=stream,
                                                        timeout=timeout) for i in range(n))))

        return self.loop().run(many(), timeout=timeout + 10)

    def chats_during(self, n: int, max_tokens: int, action: Callable[[], object], *, after_tokens: int = 5,
                     timeout: float = 150.0) -> list[Stream]:
        """``n`` concurrent streams; once each has received ``after_tokens`` tokens, ``action()``
        runs (in a thread: it may block) while they go on. Each stream records how many tokens it
        had then, so a test can tell the streams the action really cut from those already done."""

        async def run() -> list[Stream]:
            streams = [Stream() for _ in range(n)]
            async with aiohttp.ClientSession() as s:
                tasks = [asyncio.ensure_future(chat(s, max_tokens, f"during {i} {time.monotonic()} " * 8,
                                                    timeout=timeout, out=streams[i])) for i in range(n)]
                end = time.monotonic() + 60
                while not all(st.tokens >= after_tokens or st.done or st.errors for st in streams):
                    if time.monotonic() > end or all(t.done() for t in tasks):
                        break
                    await asyncio.sleep(0.02)
                for st in streams:
                    st.tokens_at_action = st.tokens
                await asyncio.to_thread(action)
                await asyncio.gather(*tasks)
            return streams

        return self.loop().run(run(), timeout=timeout + 30)
