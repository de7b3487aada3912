"""End-to-end scaffolding: boot a real deployment with ``python -m actors.supervisor`` as a user does.

Each deployment gets its own free ports (embedded nats-server, OpenAI HTTP, worker status ports), its
own namespace and run_dir, so nothing collides with a developer's ``make run`` or another test module.
The CLI runs in its own session (process group): teardown SIGTERMs the root supervisor only (as
systemd or Ctrl-C would), asserts exit code 0, then checks that no process of the group is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from config.paths import HOME_ENV, vllm_actors_home

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = ROOT / "topologies"
PY = sys.executable
WORKER_HEADER = "x-worker-instance-id"
PREFILL_HEADER = "x-prefill-instance-id"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 1) -> int:
    """A free port p such that p .. p+span-1 are all free right now (status ports: one per replica).

    Drawn below the kernel's ephemeral range: a port the kernel hands out itself (bind to 0, an
    outgoing connection) can go to another socket in the seconds before the deployment binds it,
    and an engine's NIXL listener once failed so ("Address already in use" on a port picked free,
    the engine never ready). Below that range only an explicit bind can take it."""
    rng = random.Random()
    high = _ephemeral_low() - span
    for _ in range(100):
        p = rng.randrange(10000, high)
        ok = True
        for q in range(p, p + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no free port range")


def http_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        with contextlib.suppress(ValueError):
            return e.code, json.loads(body)
        return e.code, body


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Deployment:
    """One ``python -m actors.supervisor TOPOLOGY`` subprocess."""

    def __init__(self, topology: str, tmp: Path, namespace: str, sets: list[str] | None = None,
                 model: str = "tiny", status_pools: dict[str, int] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.topology = str(TOPOLOGIES / topology)
        self.tmp = tmp
        self.namespace = namespace
        self.model = model
        self.bus_port = free_port()
        self.http_port = free_port()
        # pool -> first status port (replica i listens on port + i)
        self.status_ports = {pool: free_port(n) for pool, n in (status_pools or {}).items()}
        self.args = ["--set", f"bus.port={self.bus_port}", "--set", f"frontend.http=127.0.0.1:{self.http_port}",
                     "--set", f"namespace={namespace}", "--set", f"run_dir={tmp / 'run'}"]
        for pool, port in self.status_ports.items():
            self.args += ["--set", f"pools.{pool}.status_port={port}"]
        self.args += [a for s in (sets or []) for a in ("--set", s)]
        self.env = env or {}
        self.log = tmp / "supervisor.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def bus_url(self) -> str:
        return f"nats://127.0.0.1:{self.bus_port}"

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([PY, "-m", "actors.supervisor", self.topology, *self.args], cwd=ROOT,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **self.env})

    def output(self, tail: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-tail:]

    def health(self) -> tuple[int, Any]:
        return http_json(f"{self.url}/health")

    def instances(self, role: str | None = None) -> list[str]:
        status, body = self.health()
        if status != 200:
            return []
        return [i["instance"] for i in body["instances"] if role is None or i["role"] == role]

    def wait_ready(self, instances: dict[str, int], timeout: float) -> None:
        """Until /health is 200 with at least ``instances[role]`` ready instances per role and
        /v1/models lists the model."""
        assert self.proc is not None
        end = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"supervisor exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(OSError, ValueError):
                status, body = self.health()
                last = (status, body)
                if status == 200 and all(
                        sum(1 for i in body["instances"] if i["role"] == role) >= n for role, n in instances.items()):
                    _, models = http_json(f"{self.url}/v1/models")
                    if self.model in [m["id"] for m in models["data"]]:
                        return
            time.sleep(0.25)
        pytest.fail(f"deployment not ready after {timeout}s (last /health: {last}):\n{self.output()}")

    def wait_first_ready(self, timeout: float, requests: int = 8) -> dict[str, Any]:
        """Watch start-up as a client would (``/health`` and ``/v1/models`` polled every 20 ms, a chat
        request now and then) and, the first moment either says the model can be served, send
        ``requests`` requests at once (half chat, half completions). Checks the truth of readiness:
        before that moment /health is 503 with a per-pool body and requests are served or get
        503 + Retry-After (never 404 or 500); at that moment every request succeeds. Returns what was seen."""
        assert self.proc is not None
        end = time.monotonic() + timeout
        seen: dict[str, Any] = {"early": [], "health_503": 0}
        n = 0
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"supervisor exited with {self.proc.returncode}:\n{self.output()}")
            n += 1
            try:
                status, body = self.health()
                _, models = http_json(f"{self.url}/v1/models")
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            listed = self.model in [m["id"] for m in models.get("data", [])]
            if status == 200 or listed:
                seen["trigger"] = "health" if status == 200 else "models"
                seen["results"] = fire(self.url, self.model, requests)
                bad = [r for r in seen["results"] if r[0] != 200]
                assert not bad, f"requests sent the moment the deployment said ready failed: {bad}"
                return seen
            assert status == 503, (status, body)
            assert "pools" in body and body["status"] in ("starting", "unhealthy"), body
            seen["health_503"] += 1
            if n % 10 == 0:  # a client that does not wait for /health
                # served already (one worker of several is up: a request that can be served is),
                # or a clear 503 with Retry-After; never a 404 or 500
                code, headers, text = post(self.url + "/v1/chat/completions", chat_body(self.model))
                assert code == 200 or (code == 503 and headers.get("Retry-After")), (code, text)
                seen["early"].append(code)
            time.sleep(0.02)
        pytest.fail(f"deployment never ready in {timeout}s:\n{self.output()}")

    def wait_until(self, pred: Any, timeout: float, what: str) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with contextlib.suppress(OSError, ValueError, KeyError):
                v = pred()
                if v:
                    return v
            time.sleep(0.1)
        pytest.fail(f"{what}: not reached in {timeout}s:\n{self.output(3000)}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the root supervisor; its exit code. Whatever is left in the group is killed."""
        assert self.proc is not None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return -999
        finally:
            self.leftovers = self._reap_group()

    def _reap_group(self) -> bool:
        """True when processes of the deployment's group were still alive 5 s after the CLI exited
        (they are killed then)."""
        assert self.proc is not None
        pgid = self.proc.pid  # start_new_session: the group id is the CLI's pid
        for _ in range(50):
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return False
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        return True


def chat_body(model: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens}


def post(url: str, body: dict[str, Any], timeout: float = 60.0,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode(errors="replace")


def fire(url: str, model: str, n: int) -> list[tuple[int, str]]:
    """``n`` requests at once (chat and completions alternating): (status, body head) each."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str]:
        if i % 2:
            code, _, text = post(f"{url}/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4})
        else:
            code, _, text = post(f"{url}/v1/chat/completions", chat_body(model))
        return code, text[:300]

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


def boot(tmp_path_factory: pytest.TempPathFactory, name: str, topology: str, *, ready: dict[str, int],
         timeout: float = 60.0, **kw: Any) -> Deployment:
    """Start a deployment; the first moment it says it can serve, 8 requests sent at once must all
    succeed (``Deployment.wait_first_ready``); then wait until ``ready`` instances per role are up."""
    tmp = tmp_path_factory.mktemp(name)
    d = Deployment(topology, tmp, namespace=f"e2e{name.replace('_', '')}{os.getpid()}", **kw)
    d.start()
    try:
        if d.model:
            d.wait_first_ready(timeout)
        d.wait_ready(ready, timeout)
    except BaseException:
        d.stop(20)
        raise
    return d


def shutdown(d: Deployment) -> None:
    """Teardown check: SIGTERM → exit 0 and nothing left running."""
    rc = d.stop()
    assert rc == 0, f"supervisor exit code {rc}:\n{d.output()}"
    assert not d.leftovers, f"processes of the deployment outlived the supervisor:\n{d.output()}"


def private_home(tmp: Path) -> dict[str, str]:
    """The environment of a private HOME under ``tmp`` (the default run dir follows it) that still
    finds the built tiny model."""
    (tmp / "home").mkdir()
    return {"HOME": str(tmp / "home"), HOME_ENV: str(vllm_actors_home())}


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    return private_home(tmp_path)
