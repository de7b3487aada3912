"""A child whose configuration is rejected (``Misconfigured``) is not restarted forever: a
supervisor without ``misconfigured_retries`` gives up at once with it (a worker process), one with
it (a host's root) retries while the failure stays the same and then stops that child alone, with
the reason; a process exiting with EXIT_CONFIG is such a failure, and ``serve_root`` exits with it."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

import pytest

from bus.backoff import Backoff
from supervisors.child import ChildSpec, Misconfigured
from supervisors.process import EXIT_CONFIG, ProcessChild
from supervisors.sdnotify import Notifier, serve_root
from supervisors.supervisor import Supervisor

FAST = Backoff(initial=0.01, max=0.05, multiplier=2.0, jitter=0.0)
ROOT = Path(__file__).resolve().parents[2]


class Child:
    """Starts, or fails to start with the next error of ``failures`` (then starts)."""

    def __init__(self, name: str, failures: list[BaseException], starts: list[str]) -> None:
        self.name, self.failures, self.starts = name, failures, starts
        self._exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        self.starts.append(self.name)
        if self.failures:
            raise self.failures.pop(0)

    async def wait(self) -> None:
        await self._exit

    async def stop(self, timeout: float | None) -> None:
        if not self._exit.done():
            self._exit.set_result(None)


def spec(cid: str, failures: list[BaseException], starts: list[str]) -> ChildSpec:
    return ChildSpec(cid, lambda: Child(cid, failures, starts), "permanent", 1.0)


def view(sup: Supervisor, cid: str) -> dict[str, object]:
    return sup.child(cid)


async def test_the_root_stops_a_child_after_the_same_configuration_error_and_keeps_the_rest() -> None:
    starts: list[str] = []
    bad = [Misconfigured(f"engine arg rejected (pid {pid})") for pid in (101, 202, 303, 404)]
    sup = Supervisor("root", [spec("ok", [], starts), spec("bad", bad, starts)], backoff=FAST,
                     intensity=10, misconfigured_retries=2)
    await sup.start()  # returns: every child up or stopped
    assert starts.count("bad") == 3  # the first start and 2 retries; the pid differs, the error is the same
    v = view(sup, "bad")
    assert v["state"] == "stopped" and v["restarts"] == 2
    assert v["last_exit_reason"] == ("stopped after the same configuration error 3 times: "
                                     "Misconfigured: engine arg rejected (pid 303)")
    assert view(sup, "ok")["state"] == "running" and sup.running
    with pytest.raises(Misconfigured, match=r"pid 404"):  # an operator's restart starts it again
        await sup.restart_child("bad")
    assert starts.count("bad") == 4
    await sup.stop(5)


async def test_a_different_error_or_a_success_starts_the_count_again() -> None:
    starts: list[str] = []
    failures: list[BaseException] = [Misconfigured("a"), Misconfigured("b"), Misconfigured("b"),
                                     RuntimeError("transient"), Misconfigured("b"), Misconfigured("b")]
    sup = Supervisor("root", [spec("w", failures, starts)], backoff=FAST, intensity=10, misconfigured_retries=2)
    await sup.start()
    # a, b, b (two of b), a transient crash (count reset), b, b, then up: never 3 of the same in a row
    assert starts.count("w") == 7 and view(sup, "w")["state"] == "running"
    await sup.stop(5)


async def test_without_retries_a_supervisor_gives_up_at_once_with_the_error() -> None:
    starts: list[str] = []
    sup = Supervisor("worker-agg-0", [spec("engine", [Misconfigured("engine arg rejected")] * 5, starts),
                                      spec("health", [], starts)], strategy="rest_for_one", backoff=FAST,
                     intensity=5)
    with pytest.raises(Misconfigured, match=r"^child engine: engine arg rejected$"):
        await sup.start()
    assert starts == ["engine"]  # not restarted in place, and nothing after it started


def script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


async def test_a_process_exiting_with_exit_config_is_misconfigured_with_its_last_status() -> None:
    child = ProcessChild("worker-agg-0", script(f"""
        import sys
        from supervisors.sdnotify import Notifier
        Notifier().status("failed to start: child engine: engine configuration rejected: bad dtype")
        sys.exit({EXIT_CONFIG})
    """), env={"PYTHONPATH": str(ROOT)}, ready_timeout=60)
    with pytest.raises(Misconfigured) as info:
        await child.start()
    assert str(info.value) == ("process worker-agg-0 exited with code 78 (configuration rejected) before ready: "
                               "failed to start: child engine: engine configuration rejected: bad dtype")


async def test_serve_root_exits_with_exit_config_when_the_root_fails_misconfigured() -> None:
    starts: list[str] = []
    sup = Supervisor("worker-agg-0", [spec("engine", [Misconfigured("rejected")], starts)], backoff=FAST)
    code = await serve_root(sup, asyncio.Event(), Notifier())
    assert code == EXIT_CONFIG
    crash: list[BaseException] = [RuntimeError("boom")] * 10
    sup = Supervisor("worker-agg-0", [spec("engine", crash, starts)], backoff=FAST, intensity=1)
    assert await serve_root(sup, asyncio.Event(), Notifier()) == 1

