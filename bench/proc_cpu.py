"""CPU seconds (user + system) of processes and their process trees, read from /proc.

Used by the frontend benchmark to charge a serving stack with the CPU it burned during a load
window: read before and after, subtract. Children that exit during the window lose their share
(the kernel folds it into the parent's cutime only on wait), so stacks are measured warm, with no
process churn inside the window.
"""

from __future__ import annotations

import os
import signal
import sys

TICK = os.sysconf("SC_CLK_TCK")


def own_cpu(pid: int) -> float:
    """utime + stime of one process (all its threads), seconds; 0.0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # after the ")" field 0 is state (stat field 3); utime/stime are stat fields 14/15
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def tree(pid: int) -> list[int]:
    """pid and all its live descendants."""
    seen = [pid]
    i = 0
    while i < len(seen):
        seen += children(seen[i])
        i += 1
    return seen


def tree_cpu(*pids: int) -> float:
    return sum(own_cpu(p) for root in pids for p in tree(root))


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v) - idle) / tick, sum(v) / tick


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kill_leftovers(pids: list[int]) -> None:
    """SIGKILL whichever of ``pids`` (a stopped stack's tree, by pid: never by name) still lives."""
    for q in pids:
        try:
            os.kill(q, 0)
        except OSError:
            continue
        print(f"  leftover pid {q} ({cmdline(q)[:80]}): SIGKILL", file=sys.stderr)
        try:
            os.kill(q, signal.SIGKILL)
        except OSError:
            pass
