"""The supervisor micro service over a real nats-server, driven like `nats req` (no headers)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bus.backoff import Backoff
from bus.errors import BadRequest, Conflict, NotFound
from bus.rpc import request
from supervisors.child import ChildSpec, Escalation
from supervisors.process import ProcessChild
from supervisors.service import serve_supervisor
from supervisors.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
READY = ("import time\nfrom supervisors.sdnotify import Notifier\nNotifier().ready()\n"
         "time.sleep(600)\n")


class Dummy:
    def __init__(self, name: str) -> None:
        self.name = name
        self._exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        return None

    async def wait(self) -> None:
        await self._exit

    async def stop(self, timeout: float | None) -> None:
        if not self._exit.done():
            self._exit.set_result(None)


async def raw(bus: Any, subject: str, body: str) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """What `nats req SUBJECT BODY` does: no headers at all."""
    msg = await bus.nc.request(subject, body.encode(), timeout=20)
    return (json.loads(msg.data) if msg.data else None), dict(msg.headers or {})


async def until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# What the test's "topology" describes: pool "p" is a process that reports ready, pool "bad" one that
# exits at once. A spawn picks one by name; the command is ours, never the message's.
_POOLS = {"p": [sys.executable, "-c", READY], "bad": [sys.executable, "-c", "raise SystemExit(4)"]}


def _spawner(pool: str, replica: int | None, taken: Any) -> ChildSpec:
    if pool not in _POOLS:
        raise NotFound(f"no pool {pool!r}")
    cid = f"{pool}-{replica or 0}"
    if cid in taken:
        raise Conflict(f"{cid} exists")

    def start() -> ProcessChild:
        return ProcessChild(cid, _POOLS[pool], env={"PYTHONPATH": str(ROOT)}, ready_timeout=20)
    return ChildSpec(cid, start, "temporary" if pool == "bad" else "permanent", 2.0)


@pytest.fixture
async def served(bus: Any):
    sup = Supervisor("host", [ChildSpec("a", lambda: Dummy("a"))],
                     backoff=Backoff(initial=0.01, jitter=0), intensity=10)
    await sup.start()
    svc = await serve_supervisor(bus, sup, spawner=_spawner)
    yield sup, svc
    await svc.stop()
    await sup.stop(5)


async def test_children_and_restart(bus: Any, served: Any) -> None:
    sup, svc = served
    s = bus.subjects
    reply, headers = await raw(bus, s.supervisor(bus.host, "children"), "")
    assert reply is not None and reply["supervisor"] == "host" and reply["running"] is True
    assert [c["id"] for c in reply["children"]] == ["a"]
    assert reply["children"][0]["state"] == "running"

    reply, _ = await raw(bus, s.supervisor(bus.host, "restart"), '{"id": "a"}')
    assert reply == {"status": "ok", "child": sup.child("a")}
    assert reply["child"]["restarts"] == 1

    with pytest.raises(NotFound):
        await request(bus.nc, s.supervisor(bus.host, "restart"), {"id": "nope"})
    with pytest.raises(BadRequest):
        await request(bus.nc, s.supervisor(bus.host, "restart"), {"id": "a", "bogus": 1})
    _, headers = await raw(bus, s.supervisor(bus.host, "restart"), "{not json")
    assert headers.get("Nats-Service-Error-Code") == "400"


async def test_spawn_by_pool_then_stop(bus: Any, served: Any) -> None:
    sup, svc = served
    s = bus.subjects
    reply, headers = await raw(bus, s.supervisor(bus.host, "spawn"), '{"pool": "p"}')
    assert reply is not None, headers
    child = reply["child"]
    assert reply["status"] == "ok" and child["id"] == "p-0" and child["state"] == "running" and child["pid"]
    pid = child["pid"]
    with pytest.raises(Conflict):
        await request(bus.nc, s.supervisor(bus.host, "spawn"), {"pool": "p", "replica": 0})
    with pytest.raises(NotFound):
        await request(bus.nc, s.supervisor(bus.host, "spawn"), {"pool": "nope"})

    os.kill(pid, signal.SIGKILL)  # the supervisor restarts it (permanent)
    await until(lambda: sup.child("p-0")["pid"] not in (None, pid)
                and sup.child("p-0")["state"] == "running")
    new_pid = sup.child("p-0")["pid"]

    reply, _ = await raw(bus, s.supervisor(bus.host, "stop"), '{"id": "p-0", "remove": true}')
    assert reply == {"status": "ok", "child": None}
    assert [c["id"] for c in sup.children()] == ["a"]
    with pytest.raises(ProcessLookupError):
        os.kill(new_pid, 0)

    _, headers = await raw(bus, s.supervisor(bus.host, "spawn"), '{"pool": "bad"}')
    assert "exited with code 4" in headers.get("Nats-Service-Error", "")


async def test_spawn_never_runs_a_command_from_the_message(bus: Any, served: Any, tmp_path: Path) -> None:
    """The payload that used to run /usr/bin/touch: refused as a bad request, nothing runs."""
    sup, _svc = served
    marker = tmp_path / "pwned"
    old = {"id": "p", "argv": ["/usr/bin/touch", str(marker)], "restart": "temporary", "ready": "spawn"}
    for payload in (old, {"pool": "p", "argv": ["/usr/bin/touch", str(marker)]}):
        reply, headers = await raw(bus, bus.subjects.supervisor(bus.host, "spawn"), json.dumps(payload))
        assert reply is None and headers.get("Nats-Service-Error-Code") == "400", headers
        assert "unknown field" in headers["Nats-Service-Error"]
    await asyncio.sleep(0.3)
    assert not marker.exists()
    assert [c["id"] for c in sup.children()] == ["a"]


async def test_spawn_refused_without_a_spawner(bus: Any, tmp_path: Path) -> None:
    """A nested supervisor (a worker process's) has a fixed set of children: spawn is refused."""
    sup = Supervisor("node", [], backoff=Backoff(initial=0.01, jitter=0))
    await sup.start()
    svc = await serve_supervisor(bus, sup, node="w0")
    try:
        subject = bus.subjects.supervisor_node(bus.host, "w0", "spawn")
        with pytest.raises(BadRequest, match="fixed set of children"):
            await request(bus.nc, subject, {"pool": "agg"})
        marker = tmp_path / "x"
        reply, headers = await raw(bus, subject, json.dumps(
            {"id": "p", "argv": ["/usr/bin/touch", str(marker)], "restart": "temporary", "ready": "spawn"}))
        assert reply is None and headers.get("Nats-Service-Error-Code") == "400"
        await asyncio.sleep(0.3)
        assert sup.children() == [] and not marker.exists()
    finally:
        await svc.stop()
        await sup.stop(5)


async def test_escalate_child_then_supervisor(bus: Any, served: Any) -> None:
    sup, svc = served
    s = bus.subjects
    reply, _ = await raw(bus, s.supervisor(bus.host, "escalate"),
                         '{"reason": "liveness probe failed", "child": "a"}')
    assert reply == {"status": "accepted"}
    await until(lambda: sup.child("a")["restarts"] == 1 and sup.child("a")["state"] == "running")
    assert "liveness probe failed" in sup.child("a")["last_exit_reason"]

    reply, _ = await raw(bus, s.supervisor(bus.host, "escalate"), '{"reason": "give up"}')
    assert reply == {"status": "accepted"}
    with pytest.raises(Escalation, match="give up"):
        await asyncio.wait_for(sup.wait(), 5)


async def test_micro_info_lists_the_endpoints(bus: Any, served: Any) -> None:
    _sup, svc = served
    msg = await bus.nc.request(f"$SRV.INFO.supervisor.{svc.handle.id}", b"", timeout=5)
    info = json.loads(msg.data)
    assert {e["name"] for e in info["endpoints"]} == {"children", "restart", "spawn", "stop", "escalate"}
    assert info["metadata"]["host"] == bus.host
