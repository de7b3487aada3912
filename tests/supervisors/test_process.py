"""ProcessChild: sd_notify readiness, exit reasons, signals, process groups, no orphans."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bus.backoff import Backoff
from supervisors.child import ChildSpec
from supervisors.process import ProcessChild, ProcessExited
from supervisors.supervisor import Supervisor
from tests.helpers import alive

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}


def script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


READY_THEN_SLEEP = """
    import time
    from supervisors.sdnotify import Notifier
    n = Notifier()
    n.status("loading")
    time.sleep(0.1)
    n.ready()
    time.sleep(600)
"""


async def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_ready_via_notify_and_graceful_stop(tmp_path: Path) -> None:
    log_file = tmp_path / "child.log"
    child = ProcessChild("w", script(READY_THEN_SLEEP + "\n"), env=ENV, log_file=str(log_file),
                         ready_timeout=20)
    await child.start()
    assert child.pid and alive(child.pid)
    assert child.status == "loading"
    waiter = asyncio.create_task(child.wait())
    await child.stop(5)
    await waiter  # stopped on request: not a crash
    assert child.returncode == -signal.SIGTERM
    assert not alive(child.pid)


async def test_exit_code_and_signal_are_reasons() -> None:
    child = ProcessChild("w", script("""
        from supervisors.sdnotify import Notifier
        import time
        Notifier().ready(); time.sleep(0.2); raise SystemExit(3)
    """), env=ENV, ready_timeout=20)
    await child.start()
    with pytest.raises(ProcessExited, match="exited with code 3") as ei:
        await child.wait()
    assert ei.value.returncode == 3

    child = ProcessChild("w", script(READY_THEN_SLEEP), env=ENV, ready_timeout=20)
    await child.start()
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(ProcessExited, match="killed by SIGKILL"):
        await child.wait()


async def test_exit_before_ready_and_ready_timeout() -> None:
    child = ProcessChild("w", script("raise SystemExit(7)"), env=ENV, ready_timeout=20)
    with pytest.raises(ProcessExited, match="exited with code 7 before ready"):
        await child.start()

    child = ProcessChild("w", script("import time; time.sleep(600)"), env=ENV, ready_timeout=0.5)
    with pytest.raises(TimeoutError):
        await child.start()
    assert child.returncode == -signal.SIGKILL


async def test_sigterm_ignored_then_sigkill_whole_group() -> None:
    # the child ignores SIGTERM and has a helper process in its group, like vLLM's engine core
    child = ProcessChild("w", script("""
        import signal, subprocess, sys, time
        from supervisors.sdnotify import Notifier
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        n = Notifier(); n.status(f"helper {helper.pid}"); n.ready()
        time.sleep(600)
    """), env=ENV, ready_timeout=20)
    await child.start()
    helper = int(child.status.split()[1])  # type: ignore[union-attr]
    assert alive(helper)
    await child.stop(0.3)
    assert child.returncode == -signal.SIGKILL
    assert await gone(helper)


async def test_spawn_mode_needs_no_notify() -> None:
    child = ProcessChild("w", ["sleep", "600"], ready="spawn")
    await child.start()
    assert alive(child.pid)
    await child.stop(None)
    assert child.returncode == -signal.SIGKILL


async def test_supervised_process_killed_is_restarted_with_new_pid() -> None:
    spec = ChildSpec("worker", lambda: ProcessChild("worker", script(READY_THEN_SLEEP), env=ENV,
                                                    ready_timeout=20), shutdown=2.0)
    sup = Supervisor("host", [spec], backoff=Backoff(initial=0.01, jitter=0))
    await sup.start()
    first = sup.children()[0]["pid"]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while True:
        info = sup.children()[0]
        if info["state"] == "running" and info["pid"] not in (None, first):
            break
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.05)
    assert info["restarts"] == 1 and "killed by SIGKILL" in info["last_exit_reason"]
    second = info["pid"]
    await sup.stop(5)
    assert await gone(second)


READY_THEN_EXIT_3 = """
    import time
    from supervisors.sdnotify import Notifier
    n = Notifier()
    n.ready("waiting")
    time.sleep(0.3)
    n.status("snapshot complete; not restarted")
    raise SystemExit(3)
"""


@pytest.mark.parametrize("normal,restarted", [((0, 3), False), ((0,), True)])
async def test_declared_normal_exit_code_of_a_transient_child(normal: tuple[int, ...], restarted: bool) -> None:
    # exit 3 counts as normal only where declared: then it is reported with the child's last
    # STATUS line and not restarted; otherwise it is a crash like any other
    spec = ChildSpec("worker", lambda: ProcessChild("worker", script(READY_THEN_EXIT_3), env=ENV, ready_timeout=20,
                                                    normal_exit_codes=normal), "transient", 2.0)
    sup = Supervisor("host", [spec], backoff=Backoff(initial=5.0, jitter=0))
    await sup.start()
    deadline = time.monotonic() + 20
    while (info := sup.children()[0])["state"] == "running":
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.05)
    if restarted:
        assert info["state"] == "restarting" and "ProcessExited" in info["last_exit_reason"], info
    else:
        assert info["state"] == "stopped" and info["restarts"] == 0, info
        assert info["last_exit_reason"] == "exited with code 3: snapshot complete; not restarted"
    await sup.stop(5)


def test_children_die_with_their_parent(tmp_path: Path) -> None:
    # a supervising parent process that dies without cleanup must not leave its child behind
    parent = subprocess.Popen(script(f"""
        import asyncio, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from supervisors.process import ProcessChild
        async def main():
            c = ProcessChild("w", [sys.executable, "-c", "import time; time.sleep(600)"], ready="spawn")
            await c.start()
            print(c.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """), stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert alive(pid)
        parent.kill()
        parent.wait()
        assert asyncio.run(gone(pid)), "orphan survived its parent"
    finally:
        parent.kill()
        parent.wait()
