"""Logic without NATS or HTTP: detokenization + stop strings, routing policies, the worker set."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.frontend.detok import TextStream
from actors.frontend.discovery import Worker, WorkerSet
from actors.frontend.preprocess import SHARED
from actors.frontend.routing import DirectRouter, RandomRouter, RoundRobinRouter, make_router
from actors.instances.contract import InstanceRecord, ModelCard
from actors.worker.contract import LoraRecord
from bus.errors import BadRequest, NotFound, Overloaded

TEXT = "Hello world, the stop is here: END and then more text after END. Ünïcödé 😀 ok"


@pytest.fixture(scope="module")
def pre(tiny_dir: str) -> Any:
    return SHARED.get((tiny_dir, None))


def reference(text: str, stops: list[str], include: bool) -> str:
    cut = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (cut is None or i < cut[0]):
            cut = (i, s)
    if cut is None:
        return text
    return text[:cut[0] + (len(cut[1]) if include else 0)]


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=40),
       stops=st.sampled_from([[], ["END"], ["is here"], ["D an", "xyz"], ["😀"], ["e"], ["never"]]),
       include=st.booleans())
def test_stop_strings_any_chunking(pre: Any, cuts: list[int], stops: list[str], include: bool) -> None:
    ids = pre.encode(TEXT, add_special_tokens=False)
    assert pre.decode(ids) == TEXT
    ts = TextStream(pre.backend, [1, 2, 3], stops, include_stop_str_in_output=include)
    out, i, k = [], 0, 0
    while i < len(ids) and ts.stop_hit is None:
        n = cuts[k % len(cuts)]
        out.append(ts.add_tokens(ids[i:i + n]))
        i, k = i + n, k + 1
    out.append(ts.flush())
    expect = reference(TEXT, stops, include)
    assert "".join(out) == expect
    assert (ts.stop_hit is not None) == (expect != TEXT)


def test_hold_back_releases_nothing_that_might_start_a_stop(pre: Any) -> None:
    ts = TextStream(pre.backend, None, ["STOP"])
    assert ts.add_text("abc ST") == "abc "  # "ST" might start "STOP"
    assert ts.add_text("O") == ""  # "STO" still might
    assert ts.add_text("x") == "STOx"  # released once it cannot
    assert ts.add_text(" S") == " " and ts.flush() == "S" and ts.flush() == ""
    assert ts.text == "abc STOx S" and ts.stop_hit is None


def test_text_mode_stop(pre: Any) -> None:
    ts = TextStream(None, None, ["\n\n"])
    got = ts.add_text("line one\n") + ts.add_text("\nline two")
    assert got == "line one" and ts.stop_hit == "\n\n"


def _w(i: str) -> Worker:
    return Worker(instance=i, model="m", pool="agg", role="agg", subject=f"ns.agg.generate.{i}")


def test_round_robin_random_direct() -> None:
    pool = [_w("a"), _w("b"), _w("c")]
    rr = RoundRobinRouter()
    assert [rr.choose(pool, None, set()).instance for _ in range(6)] == ["a", "b", "c"] * 2
    assert {rr.choose(pool, None, {"b"}).instance for _ in range(4)} == {"a", "c"}
    with pytest.raises(Overloaded):
        rr.choose(pool, None, {"a", "b", "c"})
    assert rr.choose(pool, None, set(), target="c").instance == "c"
    with pytest.raises(NotFound):
        rr.choose(pool, None, set(), target="zzz")
    rnd = RandomRouter()
    assert {rnd.choose(pool, None, {"a"}).instance for _ in range(50)} == {"b", "c"}
    d = DirectRouter()
    with pytest.raises(BadRequest):
        d.choose(pool, None, set())
    assert d.choose(pool, None, set(), target="b").instance == "b"
    with pytest.raises(ValueError):
        make_router("kv")
    assert make_router("kv", kv_factory=RoundRobinRouter).name == "round_robin"


def test_worker_set_tracks_registry() -> None:
    ws = WorkerSet()
    calls = []
    ws.listeners.append(lambda: calls.append(1))

    def rec(i: str, role: str = "agg", status: str = "ready", kind: str = "engine") -> InstanceRecord:
        return InstanceRecord(instance=i, kind=kind, role=role, model="m", host="h", pid=1, pool=role,
                              generate_subject=f"ns.{role}.generate.{i}", status=status)

    ws.put_instance("w1", rec("w1"))
    ws.put_instance("w2", rec("w2", status="sleeping"))
    ws.put_instance("f1", rec("f1", kind="frontend"))
    ws.put_instance("p1", rec("p1", role="prefill"))
    assert [w.instance for w in ws.serving_workers("m")] == ["w1"]
    assert [w.instance for w in ws.workers("m", "prefill")] == ["p1"]
    ws.put_instance("w2", rec("w2"))  # woke up
    assert [w.instance for w in ws.serving_workers("m")] == ["w1", "w2"]
    ws.delete_instance("w1")  # expired
    assert [w.instance for w in ws.serving_workers("m")] == ["w2"]
    card = ModelCard(served_model_name="m", pool="agg", role="agg", model_path="/x", tokenizer_path="/x",
                     context_length=100, kv_block_size=16, total_kv_blocks=10)
    ws.put_model("m.agg", card)
    assert ws.resolve_model("m")[1] is None and not ws.models["m"].has_prefill_pool
    ws.put_instance("w1", rec("w1"))  # back
    rec = LoraRecord(lora_name="ad", lora_id=1, path="/a", uri="file:///a", instance="w2", model="m")
    ws.put_lora("w2.ad", msgspec.to_builtins(rec))
    ws.put_lora("w1.ad", msgspec.to_builtins(msgspec.structs.replace(rec, instance="w1")))
    ws.put_lora("gone.ad", msgspec.to_builtins(msgspec.structs.replace(rec, instance="gone")))
    entry, lora = ws.resolve_model("ad")
    # a placement on an instance that is not live (a dead run's record) is never offered
    assert entry.name == "m" and lora == "ad" and ws.lora_instances("ad") == {"w1", "w2"}
    ws.delete_lora("w2.ad")
    assert ws.lora_instances("ad") == {"w1"}
    ws.delete_instance("w1")
    assert ws.lora_instances("ad") == set()  # its only holder expired
    ws.delete_lora("w1.ad")
    assert ws.resolve_model("ad") is None
    ws.delete_model("m.agg")
    assert ws.resolve_model("m") is None and calls


def _card(pool: str, role: str, name: str = "m") -> ModelCard:
    return ModelCard(served_model_name=name, pool=pool, role=role, model_path="/x", tokenizer_path="/x",
                     context_length=100, kv_block_size=16, total_kv_blocks=10)


def _rec(i: str, role: str, started_at: float = 1.0) -> InstanceRecord:
    return InstanceRecord(instance=i, kind="engine", role=role, model="m", host="h", pid=1, pool=role,
                          generate_subject=f"ns.{role}.generate.{i}", started_at=started_at)


def test_models_are_listed_only_while_servable() -> None:
    """A card alone lists nothing; a disaggregated model needs decode and prefill (unless decode-only
    is allowed); cards of pools whose workers are gone stop counting."""
    allow: dict[str, bool] = {"m": False}
    ws = WorkerSet(decode_only=lambda m: allow[m])
    ws.put_model("m.decode", _card("decode", "decode"))
    ws.put_model("m.prefill", _card("prefill", "prefill"))
    assert ws.models == {} and ws.known_model("m")
    ws.put_instance("p", _rec("p", "prefill"))
    assert ws.models == {}  # prefill alone cannot answer a client
    ws.put_instance("d", _rec("d", "decode"))
    assert set(ws.models) == {"m"} and ws.models["m"].has_prefill_pool
    ws.delete_instance("p")
    assert ws.models == {}  # decode without its prefill pool, fallback not allowed
    allow["m"] = True
    ws.put_instance("d", _rec("d", "decode", 2.0))
    assert set(ws.models) == {"m"} and not ws.models["m"].has_prefill_pool
    # an agg deployment after a disaggregated one: the old cards do not make it "disaggregated"
    ws2 = WorkerSet()
    ws2.put_model("m.prefill", _card("prefill", "prefill"))
    ws2.put_model("m.agg", _card("agg", "agg"))
    ws2.put_instance("a", _rec("a", "agg"))
    assert set(ws2.models["m"].cards) == {"agg"} and not ws2.models["m"].has_prefill_pool


def test_unconfirmed_instances_are_not_offered() -> None:
    """With verify on, a record is routable only once its instance answered (ghosts never are), and
    a new incarnation (restart in place: same id, new started_at) needs confirming again."""
    ws = WorkerSet(verify=True)
    ws.put_model("m.agg", _card("agg", "agg"))
    assert ws.put_instance("a", _rec("a", "agg")) is True
    assert ws.serving_workers("m") == [] and ws.models == {}
    ws.confirm("a", 0.5)  # an answer for another incarnation does not count
    assert ws.serving_workers("m") == []
    ws.confirm("a", 1.0)
    assert [w.instance for w in ws.serving_workers("m")] == ["a"] and set(ws.models) == {"m"}
    assert ws.put_instance("a", _rec("a", "agg")) is False  # heartbeat of the same incarnation
    assert ws.put_instance("a", _rec("a", "agg", 2.0)) is True
    assert ws.serving_workers("m") == []


def test_readiness_waits_for_every_pool_then_holds_until_a_pool_is_empty() -> None:
    from actors.frontend.readiness import PoolExpectation, Readiness

    ws = WorkerSet()
    ws.put_model("m.prefill", _card("prefill", "prefill"))
    ws.put_model("m.decode", _card("decode", "decode"))
    r = Readiness("m", [PoolExpectation("prefill", "prefill", 1), PoolExpectation("decode", "decode", 2)],
                  decode_fallback=False)
    children = {"worker-decode-0": {"id": "worker-decode-0", "state": "running", "pid": 1},
                "worker-decode-1": {"id": "worker-decode-1", "state": "starting", "pid": 7,
                                    "status": "engine loading"}}
    ws.put_instance("p", _rec("p", "prefill"))
    ws.put_instance("d0", _rec("d0", "decode"))
    ready, body = r.evaluate(ws, children)
    assert not ready and body["status"] == "starting"
    decode = body["pools"]["decode"]
    assert decode["ready"] == 1 and [(m["replica"], m["state"]) for m in decode["missing"]] == [(1, "loading")]
    ws.put_instance("d1", _rec("d1", "decode"))
    assert r.evaluate(ws)[0]
    ws.delete_instance("d1")  # one replica restarting in a pool of two: still serving
    assert r.evaluate(ws)[0]
    ws.delete_instance("p")  # the prefill pool is empty and decode-only is not allowed
    ready, body = r.evaluate(ws)
    assert not ready and body["status"] == "unhealthy"

    # with decode-only fallback the prefill pool is reported but not required
    ws2 = WorkerSet()
    ws2.put_model("m.decode", _card("decode", "decode"))
    ws2.put_instance("d0", _rec("d0", "decode"))
    r2 = Readiness("m", [PoolExpectation("prefill", "prefill", 1), PoolExpectation("decode", "decode", 1)],
                   decode_fallback=True)
    ready, body = r2.evaluate(ws2)
    assert ready and body["decode_fallback"] and not body["pools"]["prefill"]["required"]


def test_readiness_expects_the_replicas_the_supervisor_runs() -> None:
    """The planner moves a pool's count: /health expects the children the root runs now, not the
    topology's start count (a removed replica is not "missing", a spawned one is expected)."""
    from actors.frontend.readiness import PoolExpectation, Readiness

    def child(i: int, state: str = "running", pid: int = 1) -> dict[str, Any]:
        return {"id": f"worker-agg-{i}", "state": state, "pid": pid, "meta": {"pool": "agg", "replica": str(i)}}

    ws = WorkerSet()
    ws.put_model("m.agg", _card("agg", "agg"))
    ws.put_instance("a0", _rec("a0", "agg"))
    r = Readiness("m", [PoolExpectation("agg", "agg", 1)], decode_fallback=False)
    assert r.evaluate(ws)[0]
    # scaled up to three: two are starting
    ready, body = r.evaluate(ws, {"worker-agg-0": child(0), "worker-agg-3": child(3, "starting", pid=3),
                                  "worker-agg-1": child(1, "starting", pid=2)})
    agg = body["pools"]["agg"]
    assert ready and agg["expected"] == 3 and [m["replica"] for m in agg["missing"]] == [1, 3]
    # scaled down to one again (replicas 1 and 3 removed from the root): nothing is missing
    ready, body = r.evaluate(ws, {"worker-agg-0": child(0)})
    assert ready and body["pools"]["agg"]["expected"] == 1 and body["pools"]["agg"]["missing"] == []


def test_a_fresh_readiness_after_a_shrink_waits_only_for_the_replicas_that_run() -> None:
    """A frontend (re)started after the planner shrank a pool below the topology's count: the root's
    view has fewer replicas than the topology, and all of them serving is ready; one of them still
    starting is not. A view with more replicas than the topology does not raise the bar."""
    from actors.frontend.readiness import PoolExpectation, Readiness

    def child(i: int, state: str = "running", pid: int = 1) -> dict[str, Any]:
        return {"id": f"worker-agg-{i}", "state": state, "pid": pid, "meta": {"pool": "agg", "replica": str(i)}}

    ws = WorkerSet()
    ws.put_model("m.agg", _card("agg", "agg"))
    ws.put_instance("a0", _rec("a0", "agg"))
    r = Readiness("m", [PoolExpectation("agg", "agg", 3)], decode_fallback=False)
    ready, body = r.evaluate(ws)  # no view read yet: the topology's 3 are expected
    assert not ready and body["status"] == "starting" and body["pools"]["agg"]["minimum"] == 3
    # shrunk to two (replica 2 removed); replica 1 still starting: not yet
    ready, body = r.evaluate(ws, {"worker-agg-0": child(0), "worker-agg-1": child(1, "starting", pid=2)})
    assert not ready and body["pools"]["agg"]["minimum"] == 2, body
    # shrunk to one, and it serves: ready
    ready, body = r.evaluate(ws, {"worker-agg-0": child(0)})
    assert ready and body["status"] == "healthy", body
    assert body["pools"]["agg"]["minimum"] == 1 and body["pools"]["agg"]["expected"] == 1
    # grown to four (three of them starting): the bar stays at the topology's three
    r2 = Readiness("m", [PoolExpectation("agg", "agg", 3)], decode_fallback=False)
    for i in (1, 2):
        ws.put_instance(f"a{i}", _rec(f"a{i}", "agg"))
    grown = {f"worker-agg-{i}": child(i) for i in range(3)} | {"worker-agg-3": child(3, "starting", pid=9)}
    ready, body = r2.evaluate(ws, grown)
    assert ready and body["pools"]["agg"]["minimum"] == 3 and body["pools"]["agg"]["expected"] == 4, body
