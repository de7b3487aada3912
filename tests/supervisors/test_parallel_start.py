"""Parallel starts: independent children (workers) start at once, bounded, while the loop goes on.

Overlap is shown by order, never by timing: a gated child's start() only returns when the test
opens its gate, so "both began before either finished" is a fact, not a race.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from bus.backoff import Backoff
from bus.errors import Unavailable
from config.loader import TopologyError, topology_from_dict
from deploy.tree import describe_plan, plan_host
from supervisors.child import ChildSpec, Escalation
from supervisors.process import ProcessChild
from supervisors.supervisor import Supervisor
from tests.helpers import alive, eventually

FAST = Backoff(initial=0.01, max=0.05, multiplier=2.0, jitter=0.0)
ROOT = Path(__file__).resolve().parents[2]


class Gated:
    """A child whose start() waits for its gate; it records begin/up/stop and how many start at once."""

    def __init__(self, lab: Lab, name: str, fail: bool) -> None:
        self.lab, self.name, self.fail = lab, name, fail
        self.gate = asyncio.Event()
        self._exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.up = False
        self.stop_timeouts: list[float | None] = []
        self.status: str | None = None  # like ProcessChild: progress the supervisor shows
        self.on_status: Callable[[str], None] | None = None

    async def start(self) -> None:
        lab = self.lab
        lab.events.append(("begin", self.name))
        lab.starting += 1
        lab.max_starting = max(lab.max_starting, lab.starting)
        try:
            if self.name in lab.auto_open:
                self.gate.set()
            await self.gate.wait()
        finally:
            lab.starting -= 1
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")
        self.up = True
        lab.events.append(("up", self.name))

    async def wait(self) -> None:
        await self._exit

    async def stop(self, timeout: float | None) -> None:
        self.stop_timeouts.append(timeout)
        self.up = False
        self.lab.events.append(("stop", self.name))
        if not self._exit.done():
            self._exit.set_result(None)

    def report(self, status: str) -> None:
        self.status = status
        if self.on_status is not None:
            self.on_status(status)

    def crash(self) -> None:
        self.up = False
        self._exit.set_exception(RuntimeError(f"{self.name} boom"))


class Lab:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.made: dict[str, list[Gated]] = {}
        self.starting = 0
        self.max_starting = 0
        self.auto_open: set[str] = set()  # these start at once, without waiting for the test
        self.failures: dict[str, int] = {}  # id -> how many next starts fail

    def spec(self, cid: str, parallel: bool = True) -> ChildSpec:
        def make() -> Gated:
            fail = self.failures.get(cid, 0) > 0
            if fail:
                self.failures[cid] -= 1
            g = Gated(self, cid, fail)
            self.made.setdefault(cid, []).append(g)
            return g
        return ChildSpec(cid, make, "permanent", 1.0, parallel=parallel)

    def current(self, cid: str) -> Gated:
        return self.made[cid][-1]

    def began(self, cid: str) -> bool:
        return ("begin", cid) in self.events

    def open(self, cid: str) -> None:
        self.current(cid).gate.set()

    def all_made(self) -> list[Gated]:
        return [g for gs in self.made.values() for g in gs]


def state(sup: Supervisor, cid: str) -> str:
    return sup.child(cid)["state"]


async def test_parallel_children_start_concurrently() -> None:
    lab = Lab()
    sup = Supervisor("s", [lab.spec(c) for c in ("w0", "w1", "w2")], backoff=FAST)
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: all(lab.began(c) for c in ("w0", "w1", "w2")))
    assert not any(kind == "up" for kind, _ in lab.events)  # all three load at once
    assert {state(sup, c) for c in ("w0", "w1", "w2")} == {"starting"}
    for c in ("w2", "w0", "w1"):  # finishing out of order is fine
        lab.open(c)
    await asyncio.wait_for(starting, 5)
    assert [e for e in lab.events if e[0] == "up"] == [("up", "w2"), ("up", "w0"), ("up", "w1")]
    assert {state(sup, c) for c in ("w0", "w1", "w2")} == {"running"}
    await sup.stop(5)


async def test_concurrency_bound_is_respected() -> None:
    lab = Lab()
    ids = [f"w{i}" for i in range(5)]
    sup = Supervisor("s", [lab.spec(c) for c in ids], backoff=FAST, start_concurrency=2)
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: lab.began("w0") and lab.began("w1"))
    await asyncio.sleep(0.05)  # give a wrong implementation the chance to start a third
    assert [c for c in ids if lab.began(c)] == ["w0", "w1"]
    for c in ids:  # each finished start lets the next one in
        await eventually(lambda c=c: lab.began(c))
        lab.open(c)
    await asyncio.wait_for(starting, 5)
    assert lab.max_starting == 2
    assert all(lab.current(c).up for c in ids)
    await sup.stop(5)


async def test_order_non_parallel_before_and_after_parallel_ones() -> None:
    lab = Lab()
    sup = Supervisor("s", [lab.spec("nats", parallel=False), lab.spec("w0"), lab.spec("w1"),
                           lab.spec("tail", parallel=False)], backoff=FAST)
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: lab.began("nats"))
    await asyncio.sleep(0.05)
    assert not lab.began("w0") and not lab.began("w1")  # workers wait for what comes before them
    lab.open("nats")
    await eventually(lambda: lab.began("w0") and lab.began("w1"))
    lab.open("w0")
    await eventually(lambda: state(sup, "w0") == "running")
    await asyncio.sleep(0.05)
    assert not lab.began("tail")  # w1 is still starting
    lab.open("w1")
    await eventually(lambda: lab.began("tail"))
    lab.open("tail")
    await asyncio.wait_for(starting, 5)
    assert lab.events.index(("up", "w1")) < lab.events.index(("begin", "tail"))
    await sup.stop(5)


async def test_crash_of_a_parallel_child_is_handled_while_another_still_starts() -> None:
    lab = Lab()
    lab.auto_open = {"fast"}
    lab.failures["flaky"] = 1
    sup = Supervisor("s", [lab.spec("fast"), lab.spec("slow"), lab.spec("flaky")], backoff=FAST)
    lab.auto_open.add("flaky")
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: state(sup, "fast") == "running")
    lab.current("fast").crash()
    # restarted (and the flaky one's failed start retried) while "slow" is still loading
    await eventually(lambda: len(lab.made["fast"]) == 2 and state(sup, "fast") == "running")
    await eventually(lambda: len(lab.made["flaky"]) == 2 and state(sup, "flaky") == "running")
    assert state(sup, "slow") == "starting" and len(lab.made["slow"]) == 1
    assert not starting.done()
    lab.open("slow")
    await asyncio.wait_for(starting, 5)
    assert sup.child("fast")["restarts"] == 1 and "fast boom" in sup.child("fast")["last_exit_reason"]
    await sup.stop(5)


async def test_loop_serves_commands_while_workers_load() -> None:
    lab = Lab()
    lab.auto_open = {"ctl"}
    sup = Supervisor("s", [lab.spec("ctl", parallel=False), lab.spec("w0")], backoff=FAST)
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: lab.began("w0"))
    await asyncio.wait_for(sup.restart_child("ctl"), 5)  # not stuck behind the loading worker
    assert len(lab.made["ctl"]) == 2 and state(sup, "w0") == "starting"
    await sup.stop_child("w0")  # a start in flight is aborted, its child killed
    assert lab.made["w0"][0].stop_timeouts == [None] and state(sup, "w0") == "stopped"
    await asyncio.wait_for(starting, 5)  # a stopped child does not hold start() back
    await sup.stop(5)


async def test_one_for_all_crash_restarts_a_child_that_is_still_starting() -> None:
    lab = Lab()
    lab.auto_open = {"a"}
    sup = Supervisor("s", [lab.spec("a"), lab.spec("b")], strategy="one_for_all", backoff=FAST)
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: state(sup, "a") == "running" and lab.began("b"))
    first_b = lab.current("b")
    lab.current("a").crash()
    await eventually(lambda: len(lab.made["b"]) == 2)
    assert first_b.stop_timeouts == [None] and not first_b.up  # its start was aborted
    lab.open("b")
    await asyncio.wait_for(starting, 5)
    assert state(sup, "a") == "running" and state(sup, "b") == "running"
    await sup.stop(5)


async def test_stop_during_parallel_start_leaves_nothing_running() -> None:
    lab = Lab()
    lab.auto_open = {"nats", "w0"}
    sup = Supervisor("s", [lab.spec("nats", parallel=False)] + [lab.spec(f"w{i}") for i in range(3)],
                     backoff=FAST, start_concurrency=2)
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: state(sup, "w0") == "running" and lab.began("w1") and lab.began("w2"))
    await asyncio.wait_for(sup.stop(5), 5)
    with pytest.raises(Unavailable):
        await starting
    assert not any(g.up for g in lab.all_made())
    assert lab.current("w1").stop_timeouts == [None] and lab.current("w2").stop_timeouts == [None]
    assert lab.starting == 0  # no start() is still running anywhere
    assert {c["state"] for c in sup.children()} == {"stopped"}


async def test_escalation_during_parallel_start_kills_the_loading_ones() -> None:
    lab = Lab()
    lab.auto_open = {"bad"}
    lab.failures["bad"] = 100
    sup = Supervisor("s", [lab.spec("slow"), lab.spec("bad")], intensity=2, backoff=FAST)
    with pytest.raises(Escalation, match="bad cannot start"):
        await asyncio.wait_for(sup.start(), 5)
    assert len(lab.made["bad"]) == 3 and len(lab.made["slow"]) == 1
    assert lab.current("slow").stop_timeouts == [None] and lab.starting == 0
    with pytest.raises(Escalation):
        await sup.wait()


async def test_progress_lines_show_each_loading_child() -> None:
    lab = Lab()
    lines: list[str] = []
    sup = Supervisor("local", [lab.spec("nats", parallel=False), lab.spec("w0"), lab.spec("w1")],
                     backoff=FAST, on_status=lines.append)
    lab.auto_open = {"nats"}
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: lab.began("w0") and lab.began("w1"))
    assert "local: starting nats" in lines  # a sequential start keeps its own line
    assert lines[-1] == "local: 1/3 up; w0 starting; w1 starting"
    lab.current("w0").report("engine loading")
    assert lines[-1] == "local: 1/3 up; w0 starting (engine loading); w1 starting"
    assert sup.child("w0")["status"] == "engine loading" and "status" not in sup.child("w1")
    lab.open("w0")
    await eventually(lambda: lines[-1] == "local: 2/3 up; w1 starting")
    lab.open("w1")
    await asyncio.wait_for(starting, 5)
    assert lines[-1] == "local: all 3 children up"
    assert all("\n" not in line for line in lines)
    lab.current("w0").report("serving")  # progress after start-up does not repaint the line
    assert lines[-1] == "local: all 3 children up"
    await sup.stop(5)


# --- real OS processes ---------------------------------------------------------------------------

# Each process marks that it began, then waits for its peer's mark before READY=1: it can only
# become ready if the supervisor started both at once (started one after the other, the first one
# gives up and exits 1, and the supervisor escalates).
PEER = """
    import os, sys, time
    from pathlib import Path
    from supervisors.sdnotify import Notifier
    me, peer = Path(sys.argv[1]), Path(sys.argv[2])
    n = Notifier()
    me.write_text(str(os.getpid()))
    n.status("waiting for peer")
    deadline = time.monotonic() + 20
    while not peer.exists():
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.02)
    n.ready("up")
    time.sleep(600)
"""


async def test_two_process_children_start_concurrently(tmp_path: Path) -> None:
    marks = {c: tmp_path / c for c in ("p0", "p1")}

    def spec(cid: str, peer: str) -> ChildSpec:
        argv = [sys.executable, "-c", textwrap.dedent(PEER), str(marks[cid]), str(marks[peer])]
        return ChildSpec(cid, lambda: ProcessChild(cid, argv, env={"PYTHONPATH": str(ROOT)},
                                                   ready_timeout=30),
                         "permanent", 5.0, parallel=True)

    lines: list[str] = []
    sup = Supervisor("host", [spec("p0", "p1"), spec("p1", "p0")], intensity=0, backoff=FAST,
                     on_status=lines.append)
    await asyncio.wait_for(sup.start(), 40)
    kids = {c["id"]: c for c in sup.children()}
    assert {k: v["state"] for k, v in kids.items()} == {"p0": "running", "p1": "running"}
    assert all(kids[c]["status"] == "up" for c in kids)
    assert any("starting (waiting for peer)" in line for line in lines)
    pids = [int(kids[c]["pid"]) for c in kids]
    await sup.stop(5)
    await eventually(lambda: not any(alive(p) for p in pids))


# --- topology and tree -----------------------------------------------------------------------------


def test_start_concurrency_is_validated_and_reaches_the_plan(tmp_path: Path) -> None:
    base = {"model": {"name": "m", "path": "tiny"}, "frontend": {"enabled": False},
            "pools": {"a": {"engine": "mocker", "replicas": 2}}}
    with pytest.raises(TopologyError) as info:
        topology_from_dict(base, "t.toml", ["supervisor.start_concurrency=0"])
    assert str(info.value) == "t.toml: supervisor.start_concurrency: expected int >= 1, got 0 (set by --set)"

    t = topology_from_dict(base, "t.toml", ["supervisor.start_concurrency=3"])
    plan = plan_host(t, "local", tmp_path / "t.toml")
    assert [(n.spec.id, n.spec.parallel) for n in plan.children] == [
        ("nats", False), ("inproc", False), ("worker-a-0", True), ("worker-a-1", True)]
    assert plan.supervisor.start_concurrency == 3
    assert "  2 worker(s) start in parallel, at most 3 at once, once nats, inproc are up" in \
        describe_plan(plan, t)
