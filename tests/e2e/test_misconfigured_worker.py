"""A worker whose engine rejects its configuration is stopped, not restarted forever, and says why.

As an operator meets it: a mocker deployment started with the CLI serves; its topology file is
then edited under it with an engine arg the engine refuses (the root checked the file at start, a
worker reads it at each start), and the worker is killed. The restarted worker's engine rejects
its args: the worker exits with EXIT_CONFIG at once (no restart in place), the root starts it
again while the error stays the same (MISCONFIGURED_RETRIES) and then stops it, keeps it listed
with the reason, and goes on running: ``/health`` shows the replica stopped with that reason, the
root's log names it, and no further start follows.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil

from deploy.cli import MISCONFIGURED_RETRIES
from tests.e2e.conftest import TOPOLOGIES, Deployment

REJECTED = "unknown mocker engine arg 'bogus_arg'"


def worker_pids(d: Deployment) -> list[int]:
    assert d.proc is not None
    return [p.pid for p in psutil.Process(d.proc.pid).children(recursive=True)
            if "actors.worker.process" in " ".join(p.cmdline())]


def test_a_worker_whose_engine_rejects_its_args_is_stopped_with_the_reason(tmp_path: Path) -> None:
    topo = tmp_path / "t.toml"
    text = (TOPOLOGIES / "mocker-agg.toml").read_text()
    assert text.rstrip().splitlines()[-1].startswith("speedup_ratio")  # the last table is the engine args
    topo.write_text(text)
    d = Deployment(str(topo), tmp_path, "misconfigured")
    d.start()
    try:
        d.wait_until(lambda: d.health()[0] == 200, 120, "the deployment serving")
        [pid] = worker_pids(d)
        topo.write_text(text.rstrip() + "\nbogus_arg = 1\n")
        psutil.Process(pid).send_signal(signal.SIGKILL)

        def stopped() -> str | None:
            status, body = d.health()
            words = json.dumps(body)
            return words if status == 503 and "stopped after the same configuration error" in words else None

        body = d.wait_until(stopped, 120, "the worker stopped for its configuration")
        attempts = MISCONFIGURED_RETRIES + 1
        assert f"stopped after the same configuration error {attempts} times" in body
        assert REJECTED in body and "exited with code 78 (configuration rejected)" in body
        time.sleep(3)  # nothing starts it again
        log = d.output(10**7)
        assert log.count("process worker-agg-0 started: pid") == 1 + attempts, log[-4000:]
        assert not worker_pids(d)
        # the worker gave up at once each time: its engine actor was started once per process
        assert log.count("a restart would fail the same way") == attempts, log[-4000:]
        assert "not restarted (restart_child starts it again)" in log
        assert d.proc is not None and d.proc.poll() is None  # the root goes on
    finally:
        assert d.stop(30) == 0, d.output()
