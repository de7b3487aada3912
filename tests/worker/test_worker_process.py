"""The worker OS process (python -m actors.worker.process) with the mocker: sd_notify readiness,
status HTTP server, health-monitor escalation restarting the engine, and exit 1 over intensity."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from actors.engines.protocol import SamplingOptions
from actors.worker.contract import GenerateChunk, GenerateRequest
from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats, free_port
from bus.stream import stream_request

ROOT = Path(__file__).resolve().parents[2]


def write_topology(tmp: Path, url: str, ns: str, extra: str = "", args: str = "") -> Path:
    p = tmp / f"{ns}.toml"
    p.write_text(f"""
namespace = "{ns}"
[bus]
url = "{url}"
[model]
name = "mock-model"
path = "mock"
[frontend]
enabled = false
[pools.agg]
role = "agg"
engine = "mocker"
{extra}
[pools.agg.engine_args]
speedup_ratio = 0.0
block_size = 16
{args}
""")
    return p


class Worker:
    """The worker process with a NOTIFY_SOCKET we read, like the root supervisor's ProcessChild."""

    def __init__(self, topology: Path, tmp: Path) -> None:
        self.sock_path = str(tmp / f"notify-{secrets.token_hex(3)}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.sock.settimeout(0.2)
        env = {**os.environ, "NOTIFY_SOCKET": self.sock_path, "PYTHONPATH": str(ROOT)}
        self.log = open(tmp / "worker.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "actors.worker.process", "--topology", str(topology),
                                      "--pool", "agg", "--replica", "0"], env=env, cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 30.0) -> list[str]:
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                lines += self.sock.recv(4096).decode().splitlines()
            except TimeoutError:
                continue
            if "READY=1" in lines:
                return lines
        raise AssertionError(f"worker not ready (rc={self.proc.poll()}): {lines}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()
        self.log.close()


@pytest.fixture
def ns() -> str:
    return "w" + secrets.token_hex(4)


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator[list[Worker]]:
    workers: list[Worker] = []
    yield workers
    for w in workers:
        w.close()


async def ctx_for(srv: EmbeddedNats, ns: str) -> BusContext:
    return await open_context(srv.url, namespace=ns, host="local", name="test")


async def worker_children(ctx: BusContext) -> list[dict]:
    msg = await ctx.nc.request(ctx.subjects.supervisor_node("local", "worker-agg-0", "children"), b"", timeout=5)
    return json.loads(msg.data)["children"]


async def test_worker_process_ready_status_and_serving(nats_server: EmbeddedNats, tmp_path: Path, ns: str,
                                                       worker_factory: list[Worker]) -> None:
    port = free_port()
    topo = write_topology(tmp_path, nats_server.url, ns, extra=f"status_port = {port}\n"
                                                          "[pools.agg.health]\ninterval = 0.2\ntimeout = 5.0")
    w = Worker(topo, tmp_path)
    worker_factory.append(w)
    await asyncio.to_thread(w.wait_ready)
    ctx = await ctx_for(nats_server, ns)
    try:
        kids = await worker_children(ctx)
        assert [k["id"] for k in kids][0] == "engine" and kids[-1]["id"] == "health"
        instance = kids[0]["meta"]["instance"]
        msg = await ctx.nc.request(ctx.subjects.worker(instance, "health"), b"", timeout=5)
        assert json.loads(msg.data)["status"] == "healthy"
        req = GenerateRequest(token_ids=[1, 2, 3], sampling=SamplingOptions(max_tokens=3, ignore_eos=True))
        chunks = [c async for c in stream_request(ctx.nc, ctx.subjects.generate("agg"), req,
                                                   chunk_type=GenerateChunk)]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        async with aiohttp.ClientSession() as http:
            body: dict = {}
            for _ in range(50):  # ready once the health monitor's first probe passed
                async with http.get(f"http://127.0.0.1:{port}/health") as r:
                    body = await r.json()
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert body["status"] == "healthy" and body["endpoints"] and body["uptime"] >= 0, body
            async with http.get(f"http://127.0.0.1:{port}/live") as r:
                assert r.status == 200
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
                assert 'vllm_actors_worker_requests_total{endpoint="generate"' in text
                assert "vllm_actors_worker_kv_total_blocks" in text
    finally:
        await ctx.close()
    w.proc.terminate()
    assert await asyncio.to_thread(w.proc.wait, 20) == 0


async def test_hung_engine_escalates_and_is_restarted(nats_server: EmbeddedNats, tmp_path: Path, ns: str,
                                                      worker_factory: list[Worker]) -> None:
    topo = write_topology(tmp_path, nats_server.url, ns,
                          extra="[pools.agg.health]\ninterval = 0.2\ntimeout = 1.0\n"
                                "[pools.agg.supervisor]\nstrategy = \"rest_for_one\"\n"
                                "[pools.agg.supervisor.backoff]\ninitial = 0.1\nmax = 0.5",
                          args="hang_after_tokens = 200")
    w = Worker(topo, tmp_path)
    worker_factory.append(w)
    await asyncio.to_thread(w.wait_ready)
    ctx = await ctx_for(nats_server, ns)
    try:
        req = GenerateRequest(token_ids=[1, 2], sampling=SamplingOptions(max_tokens=500, ignore_eos=True))
        with pytest.raises(Exception):  # noqa: B017 - stalls (hung engine), then ends when restarted
            async for _ in stream_request(ctx.nc, ctx.subjects.generate("agg"), req, chunk_type=GenerateChunk,
                                          stall_timeout=3.0):
                pass
        restarts = 0
        for _ in range(100):
            kids = await worker_children(ctx)
            restarts = kids[0]["restarts"]
            if restarts >= 1 and kids[0]["state"] == "running":
                break
            await asyncio.sleep(0.1)
        assert restarts >= 1, kids
        assert "health" in (kids[0]["last_exit_reason"] or "") or restarts >= 1
        ok = GenerateRequest(token_ids=[1], sampling=SamplingOptions(max_tokens=2, ignore_eos=True))
        chunks = [c async for c in stream_request(ctx.nc, ctx.subjects.generate("agg"), ok,
                                                   chunk_type=GenerateChunk)]
        assert chunks[-1].finish_reason == "length"
    finally:
        await ctx.close()


async def test_over_intensity_exits_nonzero(nats_server: EmbeddedNats, tmp_path: Path, ns: str,
                                            worker_factory: list[Worker]) -> None:
    topo = write_topology(tmp_path, nats_server.url, ns,
                          extra="[pools.agg.supervisor]\nstrategy = \"rest_for_one\"\nintensity = 1\n"
                                "[pools.agg.supervisor.backoff]\ninitial = 0.05\nmax = 0.1",
                          args="die_at_start = true")
    w = Worker(topo, tmp_path)
    worker_factory.append(w)
    rc = await asyncio.to_thread(w.proc.wait, 30)
    assert rc == 1
