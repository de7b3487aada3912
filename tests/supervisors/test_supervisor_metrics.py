"""The OTP runtime's series: restarts by a bounded reason, children by state (real supervisors, a
real OS process killed with SIGKILL)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

from prometheus_client import generate_latest

from bus.backoff import Backoff
from supervisors import metrics
from supervisors.child import ChildSpec
from supervisors.process import ProcessChild
from supervisors.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
FAST = Backoff(initial=0.01, max=0.05, multiplier=2.0, jitter=0.0)
READY_THEN_SLEEP = textwrap.dedent("""
    import time
    from supervisors.sdnotify import Notifier
    Notifier().ready()
    time.sleep(600)
""")


class EngineDeadError(Exception):
    pass


class Crashing:
    """An in-process child that dies with the exception the test hands it."""

    def __init__(self) -> None:
        self._exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        pass

    async def wait(self) -> None:
        await self._exit

    async def stop(self, timeout: float | None) -> None:
        if not self._exit.done():
            self._exit.set_result(None)

    def crash(self, exc: BaseException) -> None:
        self._exit.set_exception(exc)


def restarts(sup: str, child: str, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("vllm_actors_supervisor_restarts_total",
                                             {"supervisor": sup, "child": child, "reason": reason}) or 0.0


async def until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_restart_reasons_and_children_by_state(tmp_path: Path) -> None:
    made: list[Crashing] = []

    def actor() -> Crashing:
        made.append(Crashing())
        return made[-1]

    def proc() -> ProcessChild:
        return ProcessChild("w", [sys.executable, "-c", READY_THEN_SLEEP], env={"PYTHONPATH": str(ROOT)},
                            log_file=str(tmp_path / "w.log"), ready_timeout=20)

    sup = Supervisor("metrics-t", [ChildSpec("engine", actor, "permanent", 1.0),
                                   ChildSpec("proc", proc, "permanent", 2.0),
                                   ChildSpec("after", actor, "permanent", 1.0)],
                     strategy="rest_for_one", backoff=FAST, intensity=20)
    await sup.start()
    try:
        made[0].crash(EngineDeadError("engine core died (pid 4242)"))
        # rest_for_one: the crashed child counts its own reason, its dependants the strategy
        await until(lambda: restarts("metrics-t", "engine", "EngineDeadError") == 1)
        await until(lambda: restarts("metrics-t", "proc", "rest_for_one") == 1)
        await until(lambda: all(c["state"] == "running" for c in sup.children()))
        pid = sup.child("proc")["pid"]
        os.kill(pid, signal.SIGKILL)
        await until(lambda: restarts("metrics-t", "proc", "signal SIGKILL") == 1)
        await until(lambda: all(c["state"] == "running" for c in sup.children()))
        await sup.restart_child("after")
        assert restarts("metrics-t", "after", "requested") == 1
        text = generate_latest(metrics.REGISTRY).decode()
        assert 'vllm_actors_supervisor_children{state="running",supervisor="metrics-t"} 3.0' in text
        assert 'vllm_actors_supervisor_children{state="restarting",supervisor="metrics-t"} 0.0' in text
        # the reason never carries an error's text (pids, paths): the label set stays bounded
        assert "4242" not in text
    finally:
        await sup.stop(5.0)


def test_reason_labels() -> None:
    from supervisors.child import Escalation, Misconfigured
    from supervisors.process import ProcessExited

    assert metrics.reason_label(ProcessExited("process w (pid 7) exited with code 1", 1)) == "exit 1"
    assert metrics.reason_label(ProcessExited("killed", -signal.SIGTERM)) == "signal SIGTERM"
    assert metrics.reason_label(Misconfigured("engine arg rejected")) == "misconfigured"
    assert metrics.reason_label(Escalation("too many restarts")) == "gave up"
    assert metrics.reason_label(TimeoutError("not ready within 20s")) == "TimeoutError"
    assert metrics.reason_label(None) == "exit 0"
