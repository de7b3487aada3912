"""One JetStream store, one owner: EmbeddedNats locks its store dir (flock on owner.lock), a second
server on the same store is refused naming the owner, and a dead owner never blocks a new start.
Every test runs the real nats-server binary on free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bus.connection import connect
from bus.embedded import EmbeddedNats, StoreInUse, free_port
from config.loader import load_topology
from deploy.tree import plan_host
from supervisors.child import ChildSpec
from supervisors.supervisor import Supervisor
from tests.helpers import eventually

ROOT = Path(__file__).resolve().parents[2]
MOCKER_AGG = ROOT / "topologies" / "mocker-agg.toml"


async def test_second_server_on_a_store_is_refused_naming_the_owner(tmp_path: Path) -> None:
    store = str(tmp_path / "js")
    first = EmbeddedNats(port=free_port(), store_dir=store)
    await first.start()
    try:
        second = EmbeddedNats(port=free_port(), store_dir=store)
        with pytest.raises(StoreInUse) as err:
            await second.start(timeout=5)
        msg = str(err.value)
        assert f"JetStream store {store} is in use by pid {os.getpid()} " in msg
        assert f"nats-server on 127.0.0.1:{first.port} pid {first.pid}" in msg
        assert "set bus.store_dir or bus.port" in msg
        assert not second.running
        # the refused start left the owner alone: its server still answers
        nc = await connect(first.url, "probe")
        await nc.close()
    finally:
        await first.stop(5.0)

    third = EmbeddedNats(port=free_port(), store_dir=store)
    await third.start()  # the store is free once its owner stopped
    try:
        assert third.running
    finally:
        await third.stop(5.0)


async def test_server_crash_frees_the_store_for_the_restart(tmp_path: Path) -> None:
    """The supervisor restarts a crashed nats child as a new EmbeddedNats on the same store: the
    crashed one must have let go of the lock."""
    store = str(tmp_path / "js")
    port = free_port()
    made: list[EmbeddedNats] = []

    def make() -> EmbeddedNats:
        made.append(EmbeddedNats(port=port, store_dir=store, name="nats"))
        return made[-1]

    sup = Supervisor("t", [ChildSpec("nats", make, "permanent", 5.0)], intensity=3, period=60.0,
                     backoff={"initial": 0.05, "max": 0.1, "multiplier": 2.0, "jitter": 0.0})
    await sup.start()
    try:
        os.kill(made[0].pid, signal.SIGKILL)  # type: ignore[arg-type]
        await eventually(lambda: len(made) == 2 and made[1].running
                         and sup.child("nats")["state"] == "running", timeout=15)
        assert sup.child("nats")["restarts"] == 1
    finally:
        await sup.stop(10.0)
    assert not made[1].running
    after = EmbeddedNats(port=free_port(), store_dir=store)
    await after.start()  # the supervisor's stop released the store as well
    await after.stop(5.0)


_HOLDER = """
import sys
from bus.embedded import StoreLock
lock = StoreLock(sys.argv[1])
lock.acquire("127.0.0.1", 1)
print("locked", flush=True)
sys.stdin.read()
"""


async def test_lock_of_a_sigkilled_owner_does_not_block(tmp_path: Path) -> None:
    store = tmp_path / "js"
    store.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(store)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"locked"
        # while the other process lives, the lock is real across processes
        blocked = EmbeddedNats(port=free_port(), store_dir=str(store))
        with pytest.raises(StoreInUse, match=f"in use by pid {holder.pid} "):
            await blocked.start(timeout=5)
    finally:
        holder.kill()  # SIGKILL: no cleanup of owner.lock in the holder
        holder.wait()
    assert (store / "owner.lock").exists()  # the stale file stays; only the flock died
    srv = EmbeddedNats(port=free_port(), store_dir=str(store))
    await srv.start()
    try:
        assert srv.running
    finally:
        await srv.stop(5.0)


def _store_of(port: int, *sets: str) -> str:
    t = load_topology(MOCKER_AGG, [f"bus.port={port}", *sets])
    plan = plan_host(t, "local", MOCKER_AGG)
    nats = next(n for n in plan.children if n.kind == "nats")
    srv = nats.spec.start()  # builds the child; nothing runs until its start()
    assert isinstance(srv, EmbeddedNats)
    assert srv.store_dir is not None
    return srv.store_dir


def test_default_store_is_per_deployment(tmp_path: Path) -> None:
    run = f"run_dir={tmp_path}"
    a, b = _store_of(4333, run), _store_of(4334, run)
    assert a == str(tmp_path / "nats-4333") and b == str(tmp_path / "nats-4334")
    assert _store_of(4333, run, f"bus.store_dir={tmp_path / 'mine'}") == str(tmp_path / "mine")

