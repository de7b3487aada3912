"""/health over several hosts: once ready, a deployment stays ready while every role the model needs
has a ready worker somewhere (a dead host empties its pools; the other hosts' pools still serve),
and becomes unhealthy only when a role has none left. Before the first ready, every pool counts."""

from __future__ import annotations

from typing import Any

from actors.frontend.discovery import WorkerSet
from actors.frontend.readiness import PoolExpectation, Readiness
from actors.instances.contract import InstanceRecord, ModelCard

POOLS = [PoolExpectation("prefill", "prefill", 1, host="a"), PoolExpectation("decode", "decode", 1, host="b"),
         PoolExpectation("decode_c", "decode", 1, host="c")]
HOSTS = {p.name: p.host for p in POOLS}
ROLES = {p.name: p.role for p in POOLS}


def _card(pool: str) -> ModelCard:
    return ModelCard(served_model_name="m", pool=pool, role=ROLES[pool], model_path="/x", tokenizer_path="/x",
                     context_length=100, kv_block_size=16, total_kv_blocks=10)


def _rec(instance: str, pool: str, pid: int) -> InstanceRecord:
    return InstanceRecord(instance=instance, kind="engine", role=ROLES[pool], model="m", host=HOSTS[pool],
                          pid=pid, pool=pool, generate_subject=f"ns.{pool}.generate.{instance}")


def _workers(decode_only: bool = True) -> WorkerSet:
    ws = WorkerSet(decode_only=lambda _model: decode_only)
    for pool in HOSTS:
        ws.put_model(f"m.{pool}", _card(pool))
    return ws


def _readiness(decode_fallback: bool = False) -> Readiness:
    return Readiness("m", list(POOLS), decode_fallback=decode_fallback)


def _ready_counts(body: dict[str, Any]) -> dict[str, int]:
    return {name: pool["ready"] for name, pool in body["pools"].items()}


def test_before_the_first_ready_one_empty_decode_pool_keeps_it_starting() -> None:
    ws, r = _workers(), _readiness()
    ws.put_instance("p", _rec("p", "prefill", 1))
    ws.put_instance("d_b", _rec("d_b", "decode", 2))
    ready, body = r.evaluate(ws)
    # the model is servable (prefill and a decode), but host c's pool has not come up yet
    assert body["models"] == ["m"]
    assert not ready and body["status"] == "starting"
    assert _ready_counts(body) == {"prefill": 1, "decode": 1, "decode_c": 0}
    assert len(body["pools"]["decode_c"]["missing"]) == 1
    ws.put_instance("d_c", _rec("d_c", "decode_c", 3))
    ready, body = r.evaluate(ws)
    assert ready and body["status"] == "healthy" and body["pools"]["decode_c"]["missing"] == []


def test_once_ready_a_dead_decode_host_leaves_it_healthy_and_both_make_it_unhealthy() -> None:
    ws, r = _workers(), _readiness()
    ws.put_instance("p", _rec("p", "prefill", 1))
    ws.put_instance("d_b", _rec("d_b", "decode", 2))
    ws.put_instance("d_c", _rec("d_c", "decode_c", 3))
    assert r.evaluate(ws)[0]

    # host b dies: its decode pool is empty, host c's decode worker still serves every request
    ws.delete_instance("d_b")
    children = {"worker-decode-0": {"id": "worker-decode-0", "state": "restarting", "pid": None,
                                    "last_exit_reason": "killed by SIGKILL"}}
    ready, body = r.evaluate(ws, children)
    assert ready and body["status"] == "healthy"
    assert _ready_counts(body) == {"prefill": 1, "decode": 0, "decode_c": 1}
    # the body still shows the empty pool, with what its replica is doing
    assert [(m["replica"], m["state"], m["detail"]) for m in body["pools"]["decode"]["missing"]] == [
        (0, "restarting", "last exit: killed by SIGKILL")]
    assert sorted(i["instance"] for i in body["instances"]) == ["d_c", "p"]

    # host c dies too: no decode worker anywhere
    ws.delete_instance("d_c")
    ready, body = r.evaluate(ws)
    assert not ready and body["status"] == "unhealthy"
    assert _ready_counts(body) == {"prefill": 1, "decode": 0, "decode_c": 0}

    # one decode host back: serving again, though host b's pool is still empty
    ws.put_instance("d_c", _rec("d_c", "decode_c", 4))
    ready, body = r.evaluate(ws)
    assert ready and body["status"] == "healthy"


def test_once_ready_an_empty_prefill_role_is_unhealthy_unless_decode_only_is_allowed() -> None:
    """Two decode pools make no prefill capacity: the prefill role empty is a role the model needs."""
    ws, r = _workers(), _readiness()  # the worker set would serve decode-only: readiness must not
    for i, (instance, pool) in enumerate([("p", "prefill"), ("d_b", "decode"), ("d_c", "decode_c")]):
        ws.put_instance(instance, _rec(instance, pool, i + 1))
    assert r.evaluate(ws)[0]
    ws.delete_instance("p")
    ready, body = r.evaluate(ws)
    assert body["models"] == ["m"]  # still servable as far as the worker set goes
    assert not ready and body["status"] == "unhealthy"

    ws2, r2 = _workers(), _readiness(decode_fallback=True)
    ws2.put_instance("d_b", _rec("d_b", "decode", 2))
    ws2.put_instance("d_c", _rec("d_c", "decode_c", 3))
    ready, body = r2.evaluate(ws2)
    assert ready and body["decode_fallback"] and not body["pools"]["prefill"]["required"]
    ws2.delete_instance("d_b")
    assert r2.evaluate(ws2)[0]  # prefill not required, one decode host left
    ws2.delete_instance("d_c")
    assert r2.evaluate(ws2)[1]["status"] == "unhealthy"


def test_a_replica_short_in_every_pool_still_serves_once_ready() -> None:
    """Pools of two on two hosts, each down to one replica: below minimum everywhere, every role served."""
    pools = [PoolExpectation("prefill", "prefill", 1, host="a"), PoolExpectation("decode", "decode", 2, host="b"),
             PoolExpectation("decode_c", "decode", 2, host="c")]
    ws, r = _workers(), Readiness("m", pools, decode_fallback=False)
    ws.put_instance("p", _rec("p", "prefill", 1))
    for i, pool in enumerate(["decode", "decode", "decode_c", "decode_c"]):
        ws.put_instance(f"{pool}-{i}", _rec(f"{pool}-{i}", pool, 10 + i))
    ready, body = r.evaluate(ws)
    assert ready
    ws.delete_instance("decode-0")
    ws.delete_instance("decode_c-2")
    ready, body = r.evaluate(ws)
    assert ready and body["status"] == "healthy" and _ready_counts(body) == {"prefill": 1, "decode": 1, "decode_c": 1}
    # a fresh frontend (never ready) with the same workers waits for every pool's minimum
    fresh = Readiness("m", pools, decode_fallback=False)
    assert fresh.evaluate(ws)[1]["status"] == "starting"


def test_a_replica_not_started_yet_is_starting_and_one_that_exited_is_restarting() -> None:
    """A supervisor marks every child due ("restarting" in its view) until the children before it
    are up: a worker that never ran is starting, one with an exit behind it is restarting."""
    r = Readiness("m", [PoolExpectation("decode", "decode", 1, host="b")], decode_fallback=False)
    ws = WorkerSet()
    queued = {"id": "worker-decode-0", "state": "restarting", "pid": None, "restarts": 0, "started_at": None,
              "last_exit_reason": None, "meta": {"pool": "decode", "replica": 0}}
    crashed = {**queued, "restarts": 1, "started_at": 1700000000.0, "last_exit_reason": "killed by SIGKILL"}
    failed_first = {**queued, "last_exit_reason": "exited with code 1"}  # its first start failed
    for child, expected in ((queued, ("starting", "waiting to start (after the children before it)")),
                            (crashed, ("restarting", "last exit: killed by SIGKILL")),
                            (failed_first, ("restarting", "last exit: exited with code 1")),
                            ({**queued, "restarts": 2}, ("restarting", "waiting out its backoff"))):
        ready, body = r.evaluate(ws, {"worker-decode-0": child}, views_complete=True)
        assert not ready and body["status"] == "starting", body
        assert [(m["state"], m["detail"]) for m in body["pools"]["decode"]["missing"]] == [expected], body
