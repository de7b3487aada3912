"""One ``python -m actors.supervisor`` deployment per benchmark run: free NATS and HTTP ports, its
own namespace and run dir, a wait until enough workers are ready, and a stop that leaves none of
its process tree behind. A mode ``R@S`` runs router ``R`` with ``frontend.prefill_load_scale=S``.
Everything it starts is this repository's own (the topology file is relative to the repository).
``BENCH_LOG_LEVEL=DEBUG`` runs the deployment at that log level (the kv router then logs every
decision with its predicted TTFT per worker) and ``stop`` keeps nothing else; the log is
``<run dir>/supervisor.log``.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp

from bench.proc_cpu import kill_leftovers, tree
from bus.embedded import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Deployment:
    """One supervisor process (own session, so its whole tree can be killed) per router mode."""

    def __init__(self, topology: str, mode: str, tag: str) -> None:
        # "kv@S" = the kv router with frontend.prefill_load_scale=S (the topology's value otherwise)
        router, _, scale = mode.partition("@")
        self.mode = mode
        self.bus_port, self.http_port = free_port(), free_port()
        self.ns = f"spb{tag}{re.sub(r'[^a-z0-9]', '', mode)}"
        self.run_dir = tempfile.mkdtemp(prefix=f"shared-prefix-{router}-")
        self.cmd = [sys.executable, "-m", "actors.supervisor", topology,
                    "--set", f"bus.port={self.bus_port}",
                    "--set", f"frontend.http=127.0.0.1:{self.http_port}",
                    "--set", f"frontend.router={router}", "--set", f"namespace={self.ns}",
                    "--set", f"run_dir={self.run_dir}", "--log-level", os.environ.get("BENCH_LOG_LEVEL", "WARNING")]
        if scale:
            self.cmd += ["--set", f"frontend.prefill_load_scale={float(scale)}"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = pathlib.Path(self.run_dir) / "supervisor.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    async def wait_ready(self, session: aiohttp.ClientSession, workers: int, timeout: float,
                         poll: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"supervisor exited ({self.proc.returncode}); see {self.log_path}")
            try:
                async with session.get(self.url + "/health") as r:
                    body = await r.json()
                    if len(body.get("instances", [])) >= workers:
                        return
            except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError):
                pass
            await asyncio.sleep(poll)
        raise TimeoutError(f"{workers} workers not ready after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # workers and nats-server start their own sessions, so remember the whole tree first
        below = tree(self.proc.pid)[1:]
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        time.sleep(0.5)
        kill_leftovers(below)  # anything of the tree still alive (a child that ignored the shutdown)
