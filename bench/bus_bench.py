"""Bus benchmark: streaming chunks/s, added latency per chunk, unary request/reply p50/p99.

Runs an embedded nats-server and an EchoActor in a *separate* OS process (as in a deployment),
and measures from this process:
  - stream throughput: chunks/s of one stream of N msgpack chunks (echo ``stream``);
  - added latency per chunk: time from the producer's ``yield`` (stamped in the chunk) to the
    consumer receiving it, chunks 2 ms apart so none waits behind another;
  - unary round trip p50/p99 of echo ``echo`` (JSON), sequential requests.

Usage: .venv/bin/python bench/bus_bench.py [--chunks 20000] [--requests 2000] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.connection import connect  # noqa: E402
from bus.embedded import EmbeddedNats, free_port  # noqa: E402
from bus.rpc import request, stream_request  # noqa: E402
from bus.subjects import Subjects  # noqa: E402

ACTOR = r"""
import asyncio, sys
from actors.echo.actor import EchoActor
from bus.context import open_context

import time
from bus.rpc import respond_stream

async def stamped(n, interval):
    for i in range(n):
        await asyncio.sleep(interval)
        yield {"i": i, "t": time.time()}

async def main(url, ns):
    bus = await open_context(url, ns, "bench", "bench-echo")
    actor = EchoActor(bus, register=False, max_concurrency=256)
    await actor.start()

    async def on_ts(msg):
        asyncio.ensure_future(respond_stream(bus.nc, msg, stamped(500, 0.002)))

    await bus.nc.subscribe(bus.subjects.echo("bench-ts"), cb=on_ts)
    await bus.nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def run(args: argparse.Namespace) -> dict[str, float]:
    srv = EmbeddedNats(port=free_port(), store_dir=tempfile.mkdtemp(prefix="bench-nats-"))
    await srv.start()
    ns = "bench"
    proc = subprocess.Popen([sys.executable, "-c", ACTOR, srv.url, ns], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    nc = None
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == b"ready", line
        nc = await connect(srv.url, "bench-client")
        s = Subjects(ns)
        out: dict[str, float] = {}
        # warm up
        async for _ in stream_request(nc, s.echo("stream"), {"count": 1000}):
            pass
        for _ in range(50):
            await request(nc, s.echo("echo"), {"message": "w"})

        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            n = 0
            async for _ in stream_request(nc, s.echo("stream"), {"count": args.chunks, "size": args.size}):
                n += 1
            rates.append(n / (time.perf_counter() - t0))
        out["stream_chunks_per_s"] = statistics.median(rates)

        # One-way latency per chunk: producer stamps time.time() when yielding, we subtract on receipt
        # (same host clock). Chunks are 2 ms apart so each travels alone, not batched.
        one_way = []
        async for c in stream_request(nc, s.echo("bench-ts"), {}):
            one_way.append((time.time() - c["t"]) * 1e6)
        out["added_latency_per_chunk_p50_us"] = pct(one_way, 50)
        out["added_latency_per_chunk_p99_us"] = pct(one_way, 99)

        lat = []
        for i in range(args.requests):
            t0 = time.perf_counter()
            await request(nc, s.echo("echo"), {"message": str(i)})
            lat.append((time.perf_counter() - t0) * 1e6)
        out["unary_p50_us"] = pct(lat, 50)
        out["unary_p99_us"] = pct(lat, 99)
        return out
    finally:
        if nc is not None:
            await nc.close()
        proc.kill()
        proc.wait()
        await srv.stop()


def write_docs(res: dict[str, float], cmd: str, args: argparse.Namespace) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    path.parent.mkdir(exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = (
        "## Bus\n\n"
        f"Command: `{cmd}`\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f} (shared with other jobs); embedded nats-server, echo actor in its own process, one client.\n\n"
        "| metric | value |\n|---|---|\n"
        f"| streaming throughput ({args.chunks} msgpack chunks, {args.size} B padding, median of 3) "
        f"| {res['stream_chunks_per_s']:,.0f} chunks/s |\n"
        f"| added latency per chunk, producer yield -> consumer receive, p50 (500 chunks 2 ms apart) "
        f"| {res['added_latency_per_chunk_p50_us']:.0f} µs |\n"
        f"| added latency per chunk, p99 | {res['added_latency_per_chunk_p99_us']:.0f} µs |\n"
        f"| unary request/reply p50 ({args.requests} sequential JSON requests) | {res['unary_p50_us']:.0f} µs |\n"
        f"| unary request/reply p99 | {res['unary_p99_us']:.0f} µs |\n"
        "\n"
    )
    start = text.find("## Bus\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1:] if end != -1 else "")
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chunks", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=0)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    for k, v in res.items():
        print(f"{k}: {v:,.1f}")
    if args.write_docs:
        write_docs(res, ".venv/bin/python bench/bus_bench.py --write-docs", args)


if __name__ == "__main__":
    main()
