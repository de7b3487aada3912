"""A stream call's inbox on the caller's side: CPU per token of put + task wake-up + get.

    .venv/bin/python bench/inbox_bench.py [--tree DIR] [--calls 2000] [--tokens 32] [--repeats 3]

This is the per-token path of every streamed token at the frontend between the inbox mux and the
StreamCall (bus.stream._CallInbox), on uvloop as the frontend runs it: ``--calls`` streams in groups
of 100 get ``--tokens`` messages each, one per loop turn, as engine steps deliver them. ``--tree``
runs another checkout's ``bus`` package (``git worktree add DIR COMMIT``) to compare two commits.
No NATS here: only the inbox's own cost (its futures and timers) is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path


async def run(box_type: type, calls: int, tokens: int) -> float:
    loop = asyncio.get_running_loop()

    async def consumer(box: object) -> None:
        for _ in range(tokens):
            await box.get(3.0)  # type: ignore[attr-defined]
        stop = getattr(box, "stop_timer", None)  # what the mux's close does, where it exists
        if stop is not None:
            stop()

    t0 = time.process_time()
    for _ in range(max(1, calls // 100)):
        boxes = [box_type() for _ in range(100)]
        tasks = [loop.create_task(consumer(b)) for b in boxes]
        await asyncio.sleep(0)
        for _ in range(tokens):
            for b in boxes:
                b.put(object())
            await asyncio.sleep(0)  # one loop turn per step
        await asyncio.gather(*tasks)
    return (time.process_time() - t0) / (max(1, calls // 100) * 100 * tokens) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sys.path.insert(0, str(a.tree.resolve()))
    import uvloop

    from bus.stream import _CallInbox

    results = [uvloop.run(run(_CallInbox, a.calls, a.tokens)) for _ in range(a.repeats)]
    print(f"{a.tree}: " + ", ".join(f"{r:.2f}" for r in results) + " µs CPU per token (put + wake + get)")


if __name__ == "__main__":
    main()
