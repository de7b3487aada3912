"""Where a serving stack's CPU goes, per process: CPU per request and per output token, and the top
frames of each Python process (py-spy).

A bench wraps its load window in ``ProcessProfile``: on entry it reads every process of the stack's
trees (utime+stime from /proc) and, with ``spy=True``, starts one ``py-spy record`` per Python
process; on exit it reads the CPU again and stops the recorders. ``table()`` renders the result as
the per-process markdown table of docs/benchmarks.md, so a change to the hot path can be judged by
the same rows before and after.

Roles (``role_of``): ``frontend`` (our supervisor root, which hosts the OpenAI frontend and the
router, or with ``frontend.processes`` > 1 hands connections to its ``actors.frontend.process``
children, which count as frontend too; Dynamo's ``dynamo.frontend``), ``api-server`` (``vllm serve``'s process), ``worker``
(a worker process: the bus side and vLLM's AsyncLLM output handling, or the whole mocker),
``engine`` (vLLM's EngineCore, a child of a worker or of the api server), ``nats-server``.

py-spy samples each non-idle thread at ``rate`` Hz from outside the process (``--nonblocking``: the
target is never paused), so a frame's share of samples is its share of the time that process was
running Python; native work (tokenizers, torch kernels) shows under the Python frame that called it.
On a busy box a sample can land on a thread that was runnable but preempted, which charges
preemption to whatever ran before it: read shares, not absolute times, and use the CPU columns
(from /proc) for amounts.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_cpu import cmdline, own_cpu, tree  # noqa: E402

# where frames' files live on this machine, longest first so site-packages wins over the stdlib
_PATH_PREFIXES = sorted({str(Path(p)) + "/" for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                                                      Path(__file__).resolve().parent.parent)}, key=len, reverse=True)
ROLE_ORDER = ["frontend", "api-server", "worker", "engine", "nats-server", "other"]


def role_of(pid: int) -> str:
    c = cmdline(pid)
    if "nats-server" in c:
        return "nats-server"
    if ("actors.supervisor" in c or "deploy.cli" in c or "dynamo.frontend" in c
            or "actors.frontend.process" in c):  # frontend.processes > 1: the root hands over to these
        return "frontend"
    if "actors.worker" in c or "dynamo.mocker" in c:
        return "worker"
    if "vllm.entrypoints" in c:
        return "api-server"
    if "multiprocessing" in c or "EngineCore" in c:
        # vLLM's EngineCore is spawned by multiprocessing from a worker or from the api server
        return "engine"
    return "other"


@dataclass
class ProcRow:
    role: str
    pids: list[int]
    cpu_s: float
    samples: int = 0
    # (function, share of this process's samples spent in it, not in what it called)
    top_self: list[tuple[str, float]] = field(default_factory=list)


def _frame_name(frame: str) -> str:
    """'handle (aiohttp/web_protocol.py:512)' -> 'handle (aiohttp/web_protocol.py)': per function."""
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    path = loc.rsplit(":", 1)[0]
    for prefix in _PATH_PREFIXES:  # site-packages, then the stdlib, then this project
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    return f"{name} ({path})" if path else name


def parse_raw(path: Path, top: int) -> tuple[int, list[tuple[str, float]]]:
    """py-spy's raw (collapsed) output: 'frame;frame;...;leaf COUNT' per line, root first."""
    self_c: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0, []
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = [_frame_name(f) for f in stack.split(";")]
        # py-spy puts the thread ("process 123:\"python\"", "thread (0x..)") first; skip those
        frames = [f for f in frames if not f.startswith(("process ", "thread ("))]
        if not frames:
            continue
        total += count
        self_c[frames[-1]] += count
    if not total:
        return 0, []
    return total, [(f, c / total) for f, c in self_c.most_common(top)]


class ProcessProfile:
    """CPU per process (and optionally py-spy records) of the trees under ``roots`` over a window."""

    def __init__(self, roots: list[int], *, spy: bool = False, rate: int = 100, top: int = 6,
                 out_dir: Path | None = None) -> None:
        self.roots = roots
        found = shutil.which("py-spy") or _venv_py_spy()
        self._exe = str(found) if found else ""
        self.spy = spy and bool(self._exe)
        self.rate = rate
        self.top = top
        self.out_dir = out_dir or Path(tempfile.mkdtemp(prefix="proc-profile-"))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._before: dict[int, float] = {}
        self._spies: dict[int, tuple[subprocess.Popen, Path]] = {}
        self.rows: list[ProcRow] = []
        if spy and not self.spy:
            print("proc_profile: py-spy not found (pip install py-spy); CPU only", file=sys.stderr)

    def __enter__(self) -> ProcessProfile:
        pids = [q for r in self.roots for q in tree(r)]
        self._before = {q: own_cpu(q) for q in pids}
        if self.spy:
            for q in pids:
                role = role_of(q)
                # nats-server, wrk: no Python frames (vLLM retitles its EngineCore, so ask the role)
                if role == "nats-server" or role == "other" and "python" not in cmdline(q).split(" ")[0]:
                    continue
                out = self.out_dir / f"{role}-{q}.txt"
                p = subprocess.Popen([self._exe, "record", "-p", str(q), "-r", str(self.rate), "-f", "raw",
                                      "--nonblocking", "-o", str(out)],
                                     stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "w"))
                self._spies[q] = (p, out)
        return self

    def __exit__(self, *exc: object) -> None:
        after = {q: own_cpu(q) for q in self._before}
        for p, _ in self._spies.values():
            p.send_signal(signal.SIGINT)  # py-spy writes its record on SIGINT
        for p, _ in self._spies.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        by_role: dict[str, ProcRow] = {}
        for q, c0 in self._before.items():
            role = role_of(q)
            row = by_role.setdefault(role, ProcRow(role, [], 0.0))
            row.pids.append(q)
            row.cpu_s += max(0.0, after[q] - c0)
        for q, (_, out) in self._spies.items():
            row = by_role[role_of(q)]
            parsed = parse_raw(out, self.top)
            # several processes of one role (workers; an EngineCore beside multiprocessing's
            # resource tracker): the busiest one's profile stands for them
            if parsed[0] > row.samples:
                row.samples, row.top_self = parsed
        self.rows = sorted((r for r in by_role.values() if r.cpu_s > 0.005 or r.role != "other"),
                           key=lambda r: ROLE_ORDER.index(r.role))

    def table(self, requests: int, output_tokens: int, title: str = "") -> str:
        """The per-process table: CPU-s in the window, ms per request, µs per output token."""
        lines = []
        if title:
            lines.append(f"**{title}** ({requests} requests, {output_tokens} output tokens)\n")
        lines.append("| process | pids | CPU s | CPU ms / request | CPU µs / output token | top frames (self, share of samples) |")
        lines.append("|---|---|---|---|---|---|")
        total = 0.0
        for r in self.rows:
            total += r.cpu_s
            top = "; ".join(f"{f} {s:.0%}" for f, s in r.top_self) if r.top_self else ""
            lines.append(f"| {r.role} | {len(r.pids)} | {r.cpu_s:.2f} | {1e3 * r.cpu_s / max(requests, 1):.3f} | "
                         f"{1e6 * r.cpu_s / max(output_tokens, 1):.1f} | {top} |")
        lines.append(f"| **all** | | {total:.2f} | {1e3 * total / max(requests, 1):.3f} | "
                     f"{1e6 * total / max(output_tokens, 1):.1f} | |")
        return "\n".join(lines)

    def by_role(self) -> dict[str, float]:
        return {r.role: round(r.cpu_s, 3) for r in self.rows}


def _venv_py_spy() -> Path | None:
    p = Path(sys.executable).parent / "py-spy"
    return p if p.exists() and os.access(p, os.X_OK) else None
