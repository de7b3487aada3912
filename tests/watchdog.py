"""A test that runs far longer than any test should gets its asyncio tasks dumped (once), so a hang
in CI shows *where* every task waits instead of only pytest-timeout's thread stacks (an event
loop blocked in select tells nothing). The dump goes to stderr, which pytest shows for a failed
test only."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import sys
import threading
import types
from typing import Any

_CWD = os.getcwd() + os.sep
# Before the test clients' 60 s timeouts and pytest-timeout's 600 s; a slow test that passes pays one
# dump, which is shown only if it fails.
AFTER_S = float(os.environ.get("TEST_WATCHDOG_S", "45"))


def _short(path: str) -> str:
    if path.startswith(_CWD):
        return path[len(_CWD):]
    return re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", path)


def _await_chain(coro: Any) -> list[str]:
    """``file:line function`` for each coroutine/generator in the task's await chain, innermost last."""
    out: list[str] = []
    while coro is not None and len(out) < 30:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            out.append(f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
        if type(nxt).__name__ in ("async_generator_asend", "async_generator_athrow"):
            # these do not expose their generator; its referents do (a look at one object, no scan)
            nxt = next((r for r in gc.get_referents(nxt) if isinstance(r, types.AsyncGeneratorType)), nxt)
        if nxt is None or not isinstance(nxt, (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType)) \
                and not hasattr(nxt, "cr_frame"):
            if nxt is not None:
                out.append(f"awaiting {type(nxt).__name__}")
            break
        coro = nxt
    return out


def _running_loops() -> list[asyncio.AbstractEventLoop]:
    """Loops running in any thread, found from the threads' stacks (scanning gc objects instead
    would run isinstance on every object, which some lazy modules turn into side effects)."""
    loops: list[asyncio.AbstractEventLoop] = []
    for frame in sys._current_frames().values():
        f: types.FrameType | None = frame
        while f is not None:
            obj = f.f_locals.get("self") if f.f_code.co_name == "run_forever" else None
            if obj is not None and issubclass(type(obj), asyncio.AbstractEventLoop) and obj not in loops:
                loops.append(obj)
            f = f.f_back
    return loops


def dump_tasks(reason: str) -> None:
    lines = [f"=== watchdog: {reason}: asyncio tasks ==="]
    for loop in _running_loops():
        for _ in range(3):  # the set may change under us: this thread is not the loop's
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                continue
        else:
            tasks = []
        for t in tasks:
            chain = _await_chain(t.get_coro())
            lines.append(f"- {t.get_name()}: " + " > ".join(chain[-6:]))
    print("\n".join(lines), file=sys.stderr, flush=True)


def arm(test_id: str, after: float = AFTER_S) -> threading.Timer:
    timer = threading.Timer(after, dump_tasks, args=(f"{test_id} still running after {after:g}s",))
    timer.daemon = True
    timer.start()
    return timer
