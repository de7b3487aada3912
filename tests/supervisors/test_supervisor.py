"""Supervisor semantics with in-process dummy children (no NATS, no processes)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

import pytest

from bus.backoff import Backoff
from bus.errors import Conflict, NotFound, Unavailable
from supervisors.child import ChildSpec, Escalation
from supervisors.supervisor import Supervisor

FAST = Backoff(initial=0.01, max=0.05, multiplier=2.0, jitter=0.0)


class Dummy:
    """A child whose exit the test controls."""

    def __init__(self, name: str, events: list[tuple[str, str]], fail_start: BaseException | None = None,
                 stop_hangs: bool = False) -> None:
        self.name = name
        self.events = events
        self.fail_start = fail_start
        self.stop_hangs = stop_hangs
        self.stop_timeouts: list[float | None] = []
        self._exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.up = False

    async def start(self) -> None:
        self.events.append(("start", self.name))
        await asyncio.sleep(0)
        if self.fail_start is not None:
            raise self.fail_start
        self.up = True

    async def wait(self) -> None:
        await self._exit

    async def stop(self, timeout: float | None) -> None:
        self.stop_timeouts.append(timeout)
        if self.stop_hangs and timeout is not None:
            await asyncio.sleep(3600)
        self.events.append(("stop", self.name))
        self.up = False
        if not self._exit.done():
            self._exit.set_result(None)

    def crash(self, exc: BaseException | None = None) -> None:
        self.up = False
        self._exit.set_exception(exc or RuntimeError(f"{self.name} boom"))

    def exit_normally(self) -> None:
        self.up = False
        self._exit.set_result(None)


class Pool:
    """Factories for ChildSpecs; remembers every instance made per id."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.made: dict[str, list[Dummy]] = {}
        self.start_failures: dict[str, int] = {}  # id -> how many next starts fail

    def factory(self, cid: str, **kw: object) -> Callable[[], Dummy]:
        def make() -> Dummy:
            fail = None
            if self.start_failures.get(cid, 0) > 0:
                self.start_failures[cid] -= 1
                fail = RuntimeError(f"{cid} cannot start")
            d = Dummy(cid, self.events, fail_start=fail, **kw)  # type: ignore[arg-type]
            self.made.setdefault(cid, []).append(d)
            return d
        return make

    def spec(self, cid: str, restart: str = "permanent", shutdown: float | str = 1.0,
             **kw: object) -> ChildSpec:
        return ChildSpec(id=cid, start=self.factory(cid, **kw), restart=restart,  # type: ignore[arg-type]
                         shutdown=shutdown)  # type: ignore[arg-type]

    def current(self, cid: str) -> Dummy:
        return self.made[cid][-1]

    def count(self, cid: str) -> int:
        return len(self.made.get(cid, []))


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def state(sup: Supervisor, cid: str) -> dict:
    return next(c for c in sup.children() if c["id"] == cid)


def running(sup: Supervisor, pool: Pool, cid: str, n: int) -> Callable[[], bool]:
    return lambda: pool.count(cid) == n and state(sup, cid)["state"] == "running"


@pytest.fixture
def pool() -> Pool:
    return Pool()


async def make(pool: Pool, strategy: str, ids=("a", "b", "c"), **kw) -> Supervisor:
    kw.setdefault("backoff", FAST)
    sup = Supervisor("test", [pool.spec(i) for i in ids], strategy=strategy, **kw)  # type: ignore[arg-type]
    await sup.start()
    return sup


async def test_start_in_order_stop_in_reverse(pool: Pool) -> None:
    sup = await make(pool, "one_for_one")
    assert pool.events == [("start", "a"), ("start", "b"), ("start", "c")]
    assert [c["state"] for c in sup.children()] == ["running"] * 3
    await sup.stop(5)
    assert pool.events[3:] == [("stop", "c"), ("stop", "b"), ("stop", "a")]
    assert pool.current("a").stop_timeouts == [1.0]  # the spec's shutdown timeout
    await sup.wait()  # a stopped supervisor exits normally


async def test_one_for_one_restarts_only_the_crashed_child(pool: Pool) -> None:
    sup = await make(pool, "one_for_one")
    pool.current("b").crash()
    await until(running(sup, pool, "b", 2))
    assert pool.count("a") == 1 and pool.count("c") == 1
    assert pool.current("a").up and pool.current("c").up
    info = state(sup, "b")
    assert info["restarts"] == 1 and "b boom" in info["last_exit_reason"]
    await sup.stop(5)


async def test_one_for_all_restarts_everyone_in_order(pool: Pool) -> None:
    sup = await make(pool, "one_for_all")
    pool.events.clear()
    pool.current("b").crash()
    await until(lambda: all(pool.count(i) == 2 and pool.current(i).up for i in "abc"))
    # survivors stopped in reverse start order, then all started in order
    assert pool.events == [("stop", "c"), ("stop", "a"),
                           ("start", "a"), ("start", "b"), ("start", "c")]
    await sup.stop(5)


async def test_rest_for_one_restarts_the_crashed_and_later_children(pool: Pool) -> None:
    sup = await make(pool, "rest_for_one")
    pool.events.clear()
    pool.current("b").crash()
    await until(lambda: pool.count("c") == 2 and pool.current("c").up)
    assert pool.count("a") == 1 and pool.current("a").up
    assert pool.events == [("stop", "c"), ("start", "b"), ("start", "c")]
    await sup.stop(5)


async def test_restart_types(pool: Pool) -> None:
    specs = [pool.spec("perm"), pool.spec("trans", "transient"), pool.spec("tmp", "temporary"),
             pool.spec("trans2", "transient")]
    sup = Supervisor("types", specs, backoff=FAST)
    await sup.start()
    pool.current("perm").exit_normally()  # permanent: restarted even after a normal exit
    pool.current("trans").exit_normally()  # transient: a normal exit is final
    pool.current("trans2").crash()  # transient: an abnormal exit is restarted
    pool.current("tmp").crash()  # temporary: never restarted, and forgotten
    await until(running(sup, pool, "perm", 2))
    await until(running(sup, pool, "trans2", 2))
    await until(lambda: state(sup, "trans")["state"] == "stopped")
    await until(lambda: "tmp" not in [c["id"] for c in sup.children()])
    await asyncio.sleep(0.1)
    assert pool.count("trans") == 1 and pool.count("tmp") == 1
    assert state(sup, "trans")["last_exit_reason"] == "normal"
    await sup.stop(5)


async def test_intensity_exceeded_escalates_and_stops_children(pool: Pool) -> None:
    sup = await make(pool, "one_for_one", intensity=2, period=30.0)
    for n in (2, 3):
        pool.current("a").crash()
        await until(running(sup, pool, "a", n))
    pool.current("a").crash()  # third restart within the period: more than intensity=2
    with pytest.raises(Escalation, match="more than 2 restarts"):
        await asyncio.wait_for(sup.wait(), 5)
    assert not pool.current("b").up and not pool.current("c").up
    assert pool.count("a") == 3
    with pytest.raises(Unavailable):
        await sup.restart_child("b")


async def test_restarts_outside_the_period_do_not_accumulate(pool: Pool) -> None:
    sup = await make(pool, "one_for_one", ids=("a",), intensity=1, period=0.2)
    for n in (2, 3, 4):
        await asyncio.sleep(0.25)  # the previous restart has left the window
        pool.current("a").crash()
        await until(running(sup, pool, "a", n))
    assert sup.running
    await sup.stop(5)


async def test_nested_escalation_reaches_the_parent(pool: Pool) -> None:
    inners: list[Supervisor] = []

    def inner() -> Supervisor:
        s = Supervisor("inner", [pool.spec("engine"), pool.spec("kv")], strategy="rest_for_one",
                       intensity=0, backoff=FAST)
        inners.append(s)
        return s

    root = Supervisor("root", [pool.spec("frontend"), ChildSpec("worker", inner)],
                      intensity=1, period=30.0, backoff=FAST)
    await root.start()
    assert pool.current("engine").up and pool.current("kv").up
    nested = state(root, "worker")["children"]
    assert [c["id"] for c in nested] == ["engine", "kv"]

    pool.current("engine").crash()  # inner intensity 0: inner gives up, root restarts it
    await until(lambda: len(inners) == 2 and state(root, "worker")["state"] == "running")
    with pytest.raises(Escalation):
        await inners[0].wait()
    assert pool.count("engine") == 2 and pool.current("engine").up
    assert "Escalation" in state(root, "worker")["last_exit_reason"]
    assert pool.count("frontend") == 1  # one_for_one: the sibling is untouched

    pool.current("engine").crash()  # second subtree failure: root's intensity 1 exceeded
    with pytest.raises(Escalation, match="root"):
        await asyncio.wait_for(root.wait(), 5)
    assert not pool.current("frontend").up and not pool.current("kv").up


def logged_delays(caplog: pytest.LogCaptureFixture, cid: str) -> list[float]:
    """The delays the supervisor announced ("restarting a in 0.05s")."""
    pat = re.compile(rf"restarting {cid} in ([0-9.]+)s")
    return [float(m.group(1)) for r in caplog.records if (m := pat.search(r.getMessage()))]


async def test_backoff_delays_grow(pool: Pool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="supervisors.supervisor")
    backoff = Backoff(initial=0.05, max=1.0, multiplier=2.0, jitter=0.0, reset_after=60)
    sup = Supervisor("bo", [pool.spec("a")], backoff=backoff, intensity=10)
    await sup.start()
    gaps = []
    for n in (2, 3, 4):
        crashed = time.monotonic()
        pool.current("a").crash()
        await until(running(sup, pool, "a", n))
        gaps.append(time.monotonic() - crashed)
    assert logged_delays(caplog, "a") == [0.05, 0.1, 0.2]
    # and each restart really waited at least its backoff
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2
    await sup.stop(5)


async def test_backoff_resets_after_uptime(pool: Pool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="supervisors.supervisor")
    backoff = Backoff(initial=0.02, max=5.0, multiplier=10.0, jitter=0.0, reset_after=1.0)
    sup = Supervisor("bo", [pool.spec("a")], backoff=backoff, intensity=10)
    await sup.start()
    pool.current("a").crash()
    await until(running(sup, pool, "a", 2))
    pool.current("a").crash()  # crashed right after its restart: the delay grows
    await until(running(sup, pool, "a", 3))
    await asyncio.sleep(1.1)  # up longer than reset_after: the next delay is initial again
    pool.current("a").crash()
    await until(running(sup, pool, "a", 4))
    assert logged_delays(caplog, "a") == [0.02, 0.2, 0.02]
    await sup.stop(5)


def test_backoff_sequence_cap_and_jitter() -> None:
    b = Backoff(initial=0.5, max=4.0, multiplier=2.0, jitter=0.25)
    assert [b.base(i) for i in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    for i in range(6):
        for _ in range(50):
            d = b.delay(i)
            assert b.base(i) * 0.75 <= d <= min(4.0, b.base(i) * 1.25)
    assert Backoff.of({"initial": 1, "max": 2}).max == 2.0
    with pytest.raises(ValueError):
        Backoff(multiplier=0.5)


async def test_failed_start_counts_as_crash(pool: Pool) -> None:
    pool.start_failures["b"] = 2
    sup = await make(pool, "one_for_one", intensity=5)
    assert pool.count("b") == 3 and pool.current("b").up
    assert state(sup, "b")["restarts"] == 2
    await sup.stop(5)


async def test_failed_start_beyond_intensity_fails_start(pool: Pool) -> None:
    pool.start_failures["b"] = 10
    sup = Supervisor("s", [pool.spec("a"), pool.spec("b")], intensity=2, backoff=FAST)
    with pytest.raises(Escalation, match="cannot start"):
        await sup.start()
    assert not pool.current("a").up  # started siblings are stopped again


async def test_runtime_api(pool: Pool) -> None:
    sup = await make(pool, "one_for_one", ids=("a",))
    await sup.spawn(pool.spec("w1", "transient"))
    assert state(sup, "w1")["state"] == "running" and pool.current("w1").up
    with pytest.raises(Conflict):
        await sup.spawn(pool.spec("w1"))
    with pytest.raises(NotFound):
        await sup.restart_child("nope")

    await sup.restart_child("w1")  # returns once running again
    assert pool.count("w1") == 2 and pool.current("w1").up and not pool.made["w1"][0].up

    await sup.stop_child("w1")
    assert state(sup, "w1")["state"] == "stopped" and not pool.current("w1").up
    await asyncio.sleep(0.05)
    assert pool.count("w1") == 2  # a stopped child stays stopped
    await sup.restart_child("w1")  # ... until asked
    assert pool.count("w1") == 3 and state(sup, "w1")["state"] == "running"
    await sup.stop_child("w1", remove=True)
    assert [c["id"] for c in sup.children()] == ["a"]

    pool.start_failures["w2"] = 1
    with pytest.raises(RuntimeError, match="cannot start"):
        await sup.spawn(pool.spec("w2"))
    # OTP's start_child: a child whose first start fails is discarded, not restarted or counted
    assert "w2" not in [c["id"] for c in sup.children()]
    await asyncio.sleep(0.1)
    assert pool.count("w2") == 1
    await sup.spawn(pool.spec("w2"))  # the same id may be spawned again
    await until(running(sup, pool, "w2", 2))

    await sup.escalate("liveness probe failed", child="a")  # restart that child, with a reason
    await until(running(sup, pool, "a", 2))
    assert "liveness probe failed" in state(sup, "a")["last_exit_reason"]
    await sup.escalate("node lost")  # no child: the supervisor fails to its parent
    with pytest.raises(Escalation, match="node lost"):
        await asyncio.wait_for(sup.wait(), 5)
    assert not pool.current("a").up and not pool.current("w2").up


async def test_hanging_stop_is_brutally_killed(pool: Pool) -> None:
    sup = Supervisor("s", [pool.spec("a", shutdown=0.05, stop_hangs=True),
                           pool.spec("b", shutdown="brutal_kill")], backoff=FAST)
    await sup.start()
    await asyncio.wait_for(sup.stop(10), 5)
    assert pool.current("b").stop_timeouts == [None]
    assert pool.current("a").stop_timeouts == [0.05, None]  # graceful attempt, then kill
    assert not pool.current("a").up


async def test_on_status_reports_progress(pool: Pool) -> None:
    lines: list[str] = []
    sup = Supervisor("st", [pool.spec("a"), pool.spec("b")], backoff=FAST, on_status=lines.append)
    await sup.start()
    assert "st: starting a" in lines and "st: starting b" in lines
    assert lines[-1] == "st: all 2 children up"
    pool.current("a").crash()
    await until(running(sup, pool, "a", 2))
    assert any(line.startswith("st: restarting a") for line in lines)
    await sup.stop(5)


async def test_operator_restart_follows_the_strategy(pool: Pool) -> None:
    sup = await make(pool, "rest_for_one", intensity=0)  # operator restarts are not crashes
    await sup.restart_child("b")
    assert [pool.count(i) for i in "abc"] == [1, 2, 2]
    assert all(pool.current(i).up for i in "abc")
    assert sup.running
    await sup.stop(5)


async def test_stop_during_a_start_kills_the_half_started_child(pool: Pool) -> None:
    class Hang(Dummy):
        async def start(self) -> None:
            self.events.append(("start", self.name))
            await asyncio.sleep(600)

    hang: list[Hang] = []
    sup = Supervisor("s", [pool.spec("a"), ChildSpec("h", lambda: hang.append(Hang("h", pool.events))
                                                     or hang[-1])], backoff=FAST)
    starting = asyncio.create_task(sup.start())
    await until(lambda: ("start", "h") in pool.events)
    await sup.stop(5)
    with pytest.raises(Unavailable):
        await starting
    assert hang[0].stop_timeouts == [None] and not pool.current("a").up


async def test_a_stop_while_a_nested_start_swallows_its_cancellation_still_ends(pool: Pool) -> None:
    """A child's start that swallows the cancellation a stop sends it (Python 3.11's
    ``asyncio.wait_for`` loses one that arrives as the inner await completes; the frontend's start
    runs such code) must not leave its supervisor's loop waiting for its next event for good: the
    root stopped while starting its in-process actors hung."""

    class Swallow(Dummy):
        async def start(self) -> None:
            self.events.append(("start", self.name))
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                pass  # lost: the start completes as if nothing had been asked
            self.up = True

    def inner() -> Supervisor:
        return Supervisor("inproc", [ChildSpec("frontend", lambda: Swallow("frontend", pool.events)),
                                     pool.spec("waker")], strategy="rest_for_one", backoff=FAST)

    root = Supervisor("root", [pool.spec("nats"), ChildSpec("inproc", inner), pool.spec("worker")], backoff=FAST)
    starting = asyncio.create_task(root.start())
    await until(lambda: ("start", "frontend") in pool.events)
    t0 = time.monotonic()
    # within its bound: before, the inproc loop never ended and the root's kill of it waited out
    # its own 10 s bound (a root process, which awaits the loop itself, hung for good)
    await asyncio.wait_for(root.stop(5), 30)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(Unavailable):
        await starting
    assert not pool.current("nats").up and pool.count("worker") == 0
    assert pool.count("waker") == 0 or not pool.current("waker").up
