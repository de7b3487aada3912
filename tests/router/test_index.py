"""KV index: progressive prefix, removal/cleared, gaps + range, dump bootstrap, convergence, approx."""

import logging
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engines import kv_events as ve
from actors.kv import hashing
from actors.kv.contract import RouterKvEvent, StoredBlock
from actors.kv.translate import KvPublisherMetrics, KvTranslator
from actors.router.approx import ApproxIndex
from actors.router.cost import RouterConfig
from actors.router.index import KvIndex
from actors.router.kv_router import KvRouter
from actors.router.metrics import RouterMetrics

BS = 4


class FakeEngine:
    """Publishes like vLLM: opaque hashes, only new full blocks, parent = previous block's hash."""

    def __init__(self, instance: str, dp_rank: int = 0, block_size: int = BS) -> None:
        self.bs = block_size
        self.tr = KvTranslator(instance, dp_rank, block_size=BS, metrics=KvPublisherMetrics())
        self.cached: set[int] = set()

    def _vh(self, tokens, i):
        return hash(("vllm", tuple(tokens[: (i + 1) * self.bs]))) & (2**64 - 1)

    def run(self, tokens) -> list[RouterKvEvent]:
        n = len(tokens) // self.bs
        new = [i for i in range(n) if self._vh(tokens, i) not in self.cached]
        if not new:
            return []
        i0 = new[0]
        hs = [self._vh(tokens, i) for i in range(i0, n)]
        self.cached.update(hs)
        ev = ve.stored(hs, list(tokens[i0 * self.bs: n * self.bs]), self.bs,
                       parent_block_hash=self._vh(tokens, i0 - 1) if i0 else None)
        return self.tr.translate(ve.KVEventBatch(ts=0.0, events=[ev]))

    def evict(self, tokens, first_block: int) -> list[RouterKvEvent]:
        hs = [self._vh(tokens, i) for i in range(first_block, len(tokens) // self.bs)]
        self.cached.difference_update(hs)
        return self.tr.translate(ve.KVEventBatch(ts=0.0, events=[ve.removed(hs)]))

    def clear(self) -> list[RouterKvEvent]:
        self.cached.clear()
        return self.tr.translate(ve.KVEventBatch(ts=0.0, events=[ve.AllBlocksCleared()]))


def _apply(index, events):
    for e in events:
        assert index.apply(e) is None


WORKERS = [("w0", 0), ("w1", 0), ("w2", 0), ("w3", 0)]


def test_progressive_prefix_lands_on_same_worker():
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    engines = {w: FakeEngine(w[0]) for w in WORKERS}
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(8 * BS)]
    chosen = []
    for k in range(4):
        prompt = tokens[: (4 + k) * BS + 2]  # each extends the previous by one block
        d = router.route(prompt, WORKERS, request_id=f"r{k}")
        chosen.append(d.worker)
        if k:
            assert d.overlap_blocks == 3 + k
        router.first_token(f"r{k}")
        for e in engines[d.worker].run(prompt):  # the worker caches the prompt and publishes
            router.apply_event(e)
        router.finish(f"r{k}")
    assert len(set(chosen)) == 1
    assert router.metrics.hit_blocks._value.get() == 4 + 5 + 6


def test_find_matches_counts_leading_blocks_per_worker():
    idx = KvIndex(BS)
    a, b = FakeEngine("a"), FakeEngine("b")
    toks = list(range(6 * BS))
    _apply(idx, a.run(toks))
    _apply(idx, b.run(toks[: 3 * BS]))
    seqs = hashing.sequence_hashes(toks, BS)
    assert idx.find_matches(seqs) == {("a", 0): 6, ("b", 0): 3}
    assert idx.find_matches(hashing.sequence_hashes([9] * BS + toks, BS)) == {}
    # removing a middle block of "a" cuts its match there (only consecutive leading blocks count)
    _apply(idx, a.evict(toks[: 3 * BS], 2))
    assert idx.find_matches(seqs) == {("a", 0): 2, ("b", 0): 3}


def test_removed_and_cleared_semantics():
    idx = KvIndex(BS)
    a, b = FakeEngine("a"), FakeEngine("b")
    toks = list(range(4 * BS))
    _apply(idx, a.run(toks) + b.run(toks))
    assert len(idx) == 4 and idx.worker_blocks(("a", 0)) == 4
    _apply(idx, a.evict(toks, 2))
    assert len(idx) == 4  # still held by b
    assert idx.worker_blocks(("a", 0)) == 2
    _apply(idx, b.clear())
    assert len(idx) == 2 and idx.worker_blocks(("b", 0)) == 0
    assert idx.find_matches(hashing.sequence_hashes(toks, BS)) == {("a", 0): 2}
    assert idx.remove_worker("a") == 2 and len(idx) == 0 and idx.workers() == [("b", 0)]


def test_gap_detected_and_recovered_through_range():
    ref, idx = KvIndex(BS), KvIndex(BS)
    eng = FakeEngine("w")
    rng = random.Random(2)
    events = []
    for _ in range(10):
        events += eng.run([rng.randrange(50) for _ in range(3 * BS)])
    _apply(ref, events)
    _apply(idx, events[:3])
    gap = idx.apply(events[5])  # events 3 and 4 lost
    gaps = idx.pending_gaps()
    assert gaps == [gap]
    assert len(gaps) == 1 and gaps[0].start_event_id == 3 and gaps[0].end_event_id == 4
    assert not gaps[0].dump
    for e in events[6:]:
        assert idx.apply(e) is None  # buffered while recovering
    reply = eng.tr.range(gaps[0].start_event_id, gaps[0].end_event_id)
    assert idx.apply_range(reply) is None
    assert idx.pending_gaps() == [] and idx.last_event_id(("w", 0)) == events[-1].event_id
    assert idx.stats()["blocks"] == ref.stats()["blocks"]
    assert dict(idx._owners) == dict(ref._owners)


def test_range_no_longer_buffered_needs_dump_then_bootstraps():
    eng = FakeEngine("w")
    eng.tr = KvTranslator("w", 0, block_size=BS, ring_size=2, metrics=KvPublisherMetrics())
    events = []
    for i in range(6):
        events += eng.run(list(range(i * 100, i * 100 + 2 * BS)))
    idx = KvIndex(BS)
    _apply(idx, events[:1])
    gap = idx.apply(events[5])
    assert gap is not None and gap.start_event_id == 1
    gap2 = idx.apply_range(eng.tr.range(gap.start_event_id))
    assert gap2 is not None and gap2.dump
    assert idx.load_dump("w", eng.tr.snapshot()) is None
    assert idx.worker_blocks(("w", 0)) == eng.tr.num_blocks() == 12


def test_first_contact_bootstraps_from_dump_and_replays_buffer():
    eng = FakeEngine("w", dp_rank=0)
    early = eng.run(list(range(3 * BS)))
    snap = eng.tr.snapshot()  # the dump covers event 0
    later = eng.run(list(range(3 * BS)) + [7] * BS)
    idx = KvIndex(BS)
    gap = idx.apply(later[0])
    assert gap is not None and gap.dump and gap.start_event_id == 0
    assert early[0].event_id == 0 and later[0].event_id == 1
    assert idx.load_dump("w", snap) is None
    assert idx.find_matches(hashing.sequence_hashes(list(range(3 * BS)) + [7] * BS, BS)) == {("w", 0): 4}


def test_duplicates_ignored():
    idx = KvIndex(BS)
    ev = FakeEngine("w").run(list(range(BS)))
    _apply(idx, ev)
    assert idx.apply(ev[0]) is None and idx.duplicates == 1 and len(idx) == 1


def test_block_size_mismatch_events_warn(caplog):
    m = RouterMetrics()
    idx = KvIndex(BS, metrics=m)
    ev = RouterKvEvent(instance="big", event_id=0, kind="stored", block_size=16, stored=[StoredBlock(1)])
    with caplog.at_level(logging.WARNING):
        idx.apply(ev)
    assert "MISMATCH" in caplog.text and idx.worker_block_size(("big", 0)) == 16
    assert m.block_size_mismatch.labels("big", "events")._value.get() == 1


def test_two_routers_same_events_same_choice():
    engines = [FakeEngine(f"w{i}") for i in range(4)]
    rng = random.Random(5)
    prefixes = [[rng.randrange(1000) for _ in range(6 * BS)] for _ in range(8)]
    per_worker = [[] for _ in engines]
    for j, p in enumerate(prefixes):
        per_worker[j % 4] += engines[j % 4].run(p[: (2 + j % 5) * BS])
    r1 = KvRouter(RouterConfig(block_size=BS), rng=random.Random(1))
    r2 = KvRouter(RouterConfig(block_size=BS), rng=random.Random(2))
    for evs in per_worker:  # r1: worker by worker
        for e in evs:
            r1.apply_event(e)
    merged = [e for evs in zip(*per_worker, strict=False) for e in evs] + [
        e for evs in per_worker for e in evs]  # r2: interleaved, then duplicates
    for e in merged:
        r2.apply_event(e)
    for j, p in enumerate(prefixes):
        d1 = r1.route(p, [(w.tr.instance, 0) for w in engines], request_id=f"a{j}")
        d2 = r2.route(p, [(w.tr.instance, 0) for w in engines], request_id=f"a{j}")
        assert d1.worker == d2.worker == (f"w{j % 4}", 0)
        r1.finish(f"a{j}")
        r2.finish(f"a{j}")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "evict", "clear"]), st.integers(0, 3),
                          st.integers(0, 5), st.integers(1, 6)), max_size=40))
def test_find_matches_agrees_with_brute_force(ops):
    idx = KvIndex(BS)
    engines = [FakeEngine(f"w{i}") for i in range(4)]
    prompts = [[p] * BS + list(range(5 * BS)) for p in range(6)]
    for op, w, p, n in ops:
        eng = engines[w]
        toks = prompts[p][: n * BS]
        evs = eng.run(toks) if op == "store" else eng.evict(toks, max(0, n - 2)) if op == "evict" else eng.clear()
        _apply(idx, evs)
    for p in prompts:
        seqs = hashing.sequence_hashes(p, BS)
        expect = {}
        for eng in engines:
            n = 0
            while n < len(seqs) and eng._vh(p, n) in eng.cached:
                n += 1
            if n:
                expect[(eng.tr.instance, 0)] = n
        assert idx.find_matches(seqs) == expect


def test_approx_index_ttl_and_routing():
    now = [0.0]
    ax = ApproxIndex(ttl=10.0, clock=lambda: now[0])
    toks = list(range(3 * BS))
    seqs = hashing.sequence_hashes(toks, BS)
    ax.record(("a", 0), seqs)
    assert ax.find_matches(seqs) == {("a", 0): 3} and ax.worker_blocks(("a", 0)) == 3
    now[0] = 5.0
    ax.record(("a", 0), seqs[:1])  # refresh the first block only
    ax.record(("b", 0), seqs[:2])
    now[0] = 12.0
    assert ax.find_matches(seqs) == {("a", 0): 1, ("b", 0): 2}
    assert ax.prune() == 2 and ax.worker_blocks(("a", 0)) == 1
    now[0] = 20.0
    ax.prune()
    assert len(ax) == 0 and ax.find_matches(seqs) == {}
    router = KvRouter(RouterConfig(block_size=BS), mode="approx", rng=random.Random(0))
    first = router.route(toks, WORKERS, request_id="x").worker
    router.finish("x")
    again = router.route(toks + [1] * BS, WORKERS, request_id="y")
    assert again.worker == first and again.overlap_blocks == 3 and again.mode == "approx"


def test_publisher_restart_new_epoch_resets_worker():
    idx = KvIndex(BS)
    old = FakeEngine("w")
    old.tr.epoch = 1
    _apply(idx, old.run(list(range(3 * BS))))
    _apply(idx, old.run(list(range(100, 100 + 2 * BS))))
    assert idx.last_event_id(("w", 0)) == 1
    new = FakeEngine("w")
    new.tr.epoch = 2  # ids restart at 0: without epochs they would be dropped as duplicates
    _apply(idx, new.run(list(range(200, 200 + BS))))
    assert idx.worker_blocks(("w", 0)) == 1 and idx.last_event_id(("w", 0)) == 0
    assert idx.find_matches(hashing.sequence_hashes(list(range(3 * BS)), BS)) == {}
    newer = FakeEngine("w")
    newer.tr.epoch = 3
    newer.run(list(range(BS)))  # event 0 lost
    gap = idx.apply(newer.run(list(range(300, 300 + BS)))[0])
    assert gap is not None and gap.dump and idx.worker_blocks(("w", 0)) == 0
    assert idx.load_dump("w", newer.tr.snapshot()) is None and idx.worker_blocks(("w", 0)) == 2
