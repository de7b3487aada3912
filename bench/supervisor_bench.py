"""Supervisor restart time: crash → replacement child up, for an in-process and an OS-process child.

    .venv/bin/python bench/supervisor_bench.py [--n-inproc 200] [--n-proc 20] [--write]

Backoff is set to zero so the figure is the supervisor's own overhead (plus, for a process child,
fork/exec, interpreter start-up and the sd_notify READY round trip). ``--write`` replaces the
"Supervisor" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.backoff import Backoff  # noqa: E402
from supervisors.child import ChildSpec  # noqa: E402
from supervisors.process import ProcessChild  # noqa: E402
from supervisors.supervisor import Supervisor  # noqa: E402

NO_BACKOFF = Backoff(initial=0.0, max=0.0, multiplier=1.0, jitter=0.0)
READY = "import time\nfrom supervisors.sdnotify import Notifier\nNotifier().ready()\ntime.sleep(600)\n"


class Crashable:
    def __init__(self, ups: list[float]) -> None:
        self.name = "c"
        self.ups = ups
        self.exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        self.ups.append(time.perf_counter())

    async def wait(self) -> None:
        await self.exit

    async def stop(self, timeout: float | None) -> None:
        if not self.exit.done():
            self.exit.set_result(None)


class TimedProcess(ProcessChild):
    ups: list[float] = []

    async def start(self) -> None:
        await super().start()
        TimedProcess.ups.append(time.perf_counter())


async def wait_len(xs: list[float], n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(xs) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("restart did not happen")
        await asyncio.sleep(0.0005)


async def bench_inproc(n: int) -> list[float]:
    ups: list[float] = []
    made: list[Crashable] = []

    def make() -> Crashable:
        made.append(Crashable(ups))
        return made[-1]
    sup = Supervisor("bench", [ChildSpec("c", make)], backoff=NO_BACKOFF, intensity=n + 1, period=1e9)
    await sup.start()
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        made[-1].exit.set_exception(RuntimeError("crash"))
        await wait_len(ups, i + 2)
        out.append(ups[-1] - t0)
    await sup.stop(5)
    return out


async def bench_proc(n: int) -> list[float]:
    env = {"PYTHONPATH": str(ROOT)}
    ups = TimedProcess.ups
    ups.clear()
    sup = Supervisor("bench", [ChildSpec("p", lambda: TimedProcess("p", [sys.executable, "-c", READY],
                                                                 env=env, ready_timeout=30))],
                     backoff=NO_BACKOFF, intensity=n + 1, period=1e9)
    await sup.start()
    out = []
    for i in range(n):
        pid = sup.children()[0]["pid"]
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        await wait_len(ups, i + 2)
        out.append(ups[-1] - t0)
    await sup.stop(5)
    return out


async def bench_spawn(n: int) -> list[float]:
    """ProcessChild.start() alone (fork/exec + interpreter + READY): the floor under a restart."""
    out = []
    for _ in range(n):
        c = ProcessChild("p", [sys.executable, "-c", READY], env={"PYTHONPATH": str(ROOT)},
                         ready_timeout=30)
        t0 = time.perf_counter()
        await c.start()
        out.append(time.perf_counter() - t0)
        await c.stop(None)
    return out


def fmt(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(len(xs) * 0.9))]
    return (f"median {statistics.median(xs) * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms, "
            f"min {xs[0] * 1e3:.2f} ms (n={len(xs)})")


def write_section(text: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    header = "## Supervisor"
    start = doc.find(header + "\n")
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        end = doc.find("\n## ", start + len(header))
        doc = doc[:start] + text + (doc[end + 1:] if end >= 0 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-inproc", type=int, default=200)
    ap.add_argument("--n-proc", type=int, default=20)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # one restart warning per sample otherwise
    inproc = asyncio.run(bench_inproc(args.n_inproc))
    proc = asyncio.run(bench_proc(args.n_proc))
    spawn = asyncio.run(bench_spawn(args.n_proc))
    cmd = f".venv/bin/python bench/supervisor_bench.py --n-inproc {args.n_inproc} --n-proc {args.n_proc}"
    text = (
        "## Supervisor\n\n"
        "Restart time = from the crash (in-process: the child's `wait()` raises; process: SIGKILL "
        "sent) to the replacement child's `start()` returning, with backoff 0. A process child is "
        "`python -c` importing `supervisors.sdnotify` and sending `READY=1`, so its figure is "
        "dominated by interpreter start-up; a vLLM worker adds its model load on top.\n\n"
        f"Command: `{cmd} --write`  \n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()} "
        "(shared with other jobs; treat as indicative)\n\n"
        "| child | restart time |\n|---|---|\n"
        f"| in-process | {fmt(inproc)} |\n"
        f"| OS process (sd_notify READY) | {fmt(proc)} |\n"
        f"| (floor: `ProcessChild.start()` alone, no crash) | {fmt(spawn)} |\n")
    print(text)
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
