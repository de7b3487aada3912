"""Decisions booked as predicted blocks: right before any KV event arrives, and ended by events."""

from __future__ import annotations

import random

from actors.kv import hashing
from actors.kv.contract import KvSnapshot, RouterKvEvent, StoredBlock
from actors.router.cost import RouterConfig
from actors.router.kv_router import KvRouter
from actors.router.metrics import RouterMetrics
from tests.router.test_index import FakeEngine

BS = 4
WORKERS = [("w0", 0), ("w1", 0), ("w2", 0), ("w3", 0)]


def _router(**kw: object) -> KvRouter:
    return KvRouter(RouterConfig(block_size=BS), rng=random.Random(0), **kw)  # type: ignore[arg-type]


def _tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10_000) for _ in range(blocks * BS)]


def _event(worker: str, event_id: int, kind: str, **kw: object) -> RouterKvEvent:
    return RouterKvEvent(instance=worker, event_id=event_id, kind=kind, block_size=BS, **kw)  # type: ignore[arg-type]


def test_follow_up_before_any_event_goes_to_the_same_worker() -> None:
    r = _router()
    prompt = _tokens(1, 4)
    first = r.route(prompt, WORKERS, request_id="a")
    assert first.overlap_blocks == 0 and len(r.index) == 0
    r.finish("a")
    follow = r.route(prompt + _tokens(2, 2), WORKERS, request_id="b")
    assert follow.worker == first.worker and follow.overlap_blocks == 4
    assert {c.instance: c.overlap_blocks for c in follow.costs} == {
        w[0]: (4 if w == first.worker else 0) for w in WORKERS}
    # the extension is predicted too; nothing came from events
    assert r.stats()["predicted"]["blocks"] == 6 and r.stats()["index"]["blocks"] == 0
    assert r.metrics.predicted_blocks._value.get() == 6


def test_sixteen_sessions_over_four_workers_stay_put() -> None:
    r = _router()
    sessions = [_tokens(100 + s, 8) for s in range(16)]
    placed: dict[int, set[tuple[str, int]]] = {s: set() for s in range(16)}
    for turn in range(4):  # turn-major: every session's turn k before any turn k+1, no events at all
        for s, toks in enumerate(sessions):
            rid = f"s{s}t{turn}"
            d = r.route(toks[: (4 + turn) * BS + 1], WORKERS, request_id=rid)
            placed[s].add(d.worker)
            if turn:
                assert d.overlap_blocks == 3 + turn, (s, turn, d.overlap_blocks)
            r.finish(rid)
    assert all(len(ws) == 1 for ws in placed.values()), placed
    # new prefixes spread by the tie-break on (cached + predicted) blocks: 4 sessions per worker
    per_worker = [sum(1 for ws in placed.values() if w in ws) for w in WORKERS]
    assert per_worker == [4, 4, 4, 4]


def test_removed_and_cleared_end_predictions() -> None:
    r = _router()
    prompt = _tokens(3, 4)
    seqs = hashing.sequence_hashes(prompt, BS)
    w = r.route(prompt, WORKERS, request_id="a").worker
    r.finish("a")
    # the worker evicted block 2 (it never reported storing it: a prediction the events contradict)
    assert r.apply_event(_event(w[0], 0, "removed", removed=[seqs[2]])) is None
    again = r.route(prompt, WORKERS, book=False)
    assert again.worker == w and again.overlap_blocks == 2
    assert r.stats()["predicted"]["blocks"] == 3
    r.apply_event(_event(w[0], 1, "cleared"))
    assert r.stats()["predicted"]["blocks"] == 0
    assert r.route(prompt, WORKERS, book=False).overlap_blocks == 0


def test_remove_worker_ends_its_predictions_only() -> None:
    r = _router()
    a, b = _tokens(4, 3), _tokens(5, 3)
    wa = r.route(a, WORKERS, request_id="a").worker
    wb = r.route(b, WORKERS, request_id="b").worker
    assert wa != wb  # the second prefix goes to an emptier worker
    r.remove_worker(wa[0])
    assert r.predictions is not None and r.predictions.worker_blocks(wa) == 0
    assert r.predictions.worker_blocks(wb) == 3 and r.load.snapshot().keys() == {f"{wb[0]}/0"}
    r.finish("b")
    assert r.route(b, WORKERS, book=False).worker == wb
    assert r.route(a, WORKERS, book=False).overlap_blocks == 0


def test_real_events_confirm_predictions() -> None:
    r = _router()
    engines = {w: FakeEngine(w[0]) for w in WORKERS}
    prompt = _tokens(6, 5)
    w = r.route(prompt, WORKERS, request_id="a").worker
    r.finish("a")
    assert r.stats()["predicted"]["blocks"] == 5
    for e in engines[w].run(prompt[: 3 * BS]):  # the engine has stored the first three so far
        r.apply_event(e)
    assert r.stats()["predicted"]["blocks"] == 2 and r.index.worker_blocks(w) == 3
    assert r.route(prompt, WORKERS, book=False).overlap_blocks == 5  # real 3 + predicted 2
    for e in engines[w].run(prompt):
        r.apply_event(e)
    assert r.stats()["predicted"] == {"blocks": 0, "hashes": 0, "ttl": 120.0, "workers": {}}
    d = r.route(prompt, WORKERS, book=False)
    assert d.worker == w and d.overlap_blocks == 5
    # blocks the index already holds are not predicted again
    r.route(prompt + _tokens(7, 1), WORKERS, request_id="b")
    assert r.stats()["predicted"]["blocks"] == 1


def test_event_buffered_in_a_gap_confirms_nothing() -> None:
    r = _router()
    prompt = _tokens(8, 2)
    seqs = hashing.sequence_hashes(prompt, BS)
    w = r.route(prompt, WORKERS, request_id="a").worker
    r.finish("a")
    # first contact with id 3: a gap, so the index buffers the event and applies nothing yet
    gap = r.apply_event(_event(w[0], 3, "stored", stored=[StoredBlock(h) for h in seqs]))
    assert gap is not None and gap.dump
    assert r.stats()["predicted"]["blocks"] == 2
    assert r.route(prompt, WORKERS, book=False).overlap_blocks == 2


def test_dump_merges_and_keeps_other_workers_and_predictions() -> None:
    r = _router()
    eng = FakeEngine("w1")
    cached = _tokens(9, 3)
    for e in eng.run(cached):
        r.apply_event(e)
    pending = _tokens(10, 4)
    w = r.route(pending, WORKERS, request_id="p").worker
    assert w != ("w1", 0)  # emptier worker
    # a dump of the worker that holds the prediction, taken before it stored the request's blocks
    assert r.load_dump(w[0], KvSnapshot(dp_rank=0, block_size=BS, last_event_id=-1, blocks=[])) is None
    assert r.stats()["predicted"]["blocks"] == 4
    assert r.index.worker_blocks(("w1", 0)) == 3
    # a later dump that contains them confirms them
    blocks = [StoredBlock(h) for h in hashing.sequence_hashes(pending, BS)]
    r.load_dump(w[0], KvSnapshot(dp_rank=0, block_size=BS, last_event_id=0, blocks=blocks))
    assert r.stats()["predicted"]["blocks"] == 0 and r.index.worker_blocks(w) == 4
    assert r.index.worker_blocks(("w1", 0)) == 3


def test_predictions_expire_after_the_ttl() -> None:
    now = [0.0]
    r = _router(approx_ttl=30.0, clock=lambda: now[0])
    prompt = _tokens(11, 3)
    w = r.route(prompt, WORKERS, request_id="a").worker
    r.finish("a")
    now[0] = 29.0
    assert r.route(prompt, WORKERS, book=False).worker == w
    now[0] = 31.0
    assert r.route(prompt, WORKERS, book=False).overlap_blocks == 0
    assert r.stats()["predicted"]["blocks"] == 0


def test_a_query_books_nothing_and_approx_mode_has_no_overlay() -> None:
    r = _router()
    prompt = _tokens(12, 3)
    r.route(prompt, WORKERS, book=False)
    assert r.stats()["predicted"]["blocks"] == 0 and r.load.snapshot() == {}
    ax = KvRouter(RouterConfig(block_size=BS), mode="approx", metrics=RouterMetrics())
    assert ax.predictions is None and "predicted" not in ax.stats()
    first = ax.route(prompt, WORKERS, request_id="x").worker
    ax.finish("x")
    assert ax.route(prompt, WORKERS, book=False).worker == first


def test_pin_books_the_fixed_worker() -> None:
    r = _router()
    prompt = _tokens(13, 4)
    d = r.pin(prompt, ("w2", 0), request_id="p")
    assert d.worker == ("w2", 0) and r.load.snapshot()["w2/0"]["requests"] == 1
    r.finish("p")
    follow = r.route(prompt + _tokens(14, 1), WORKERS, request_id="f")
    assert follow.worker == ("w2", 0) and follow.overlap_blocks == 4
