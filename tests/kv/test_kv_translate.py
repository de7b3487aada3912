"""KV publisher logic: vLLM events → router events with token-derived hashes, numbering, index."""

import logging
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engines import kv_events as ve
from actors.kv import hashing
from actors.kv.translate import KvPublisherMetrics, KvTranslator

BS = 4


def _batch(*events, rank=0):
    return ve.KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=rank)


def _opaque(rng):
    return rng.getrandbits(64)


def _store(tokens, vhashes, parent=None, **kw):
    return ve.stored(vhashes, tokens, kw.pop("block_size", BS), parent_block_hash=parent, **kw)


def _seqs(events):
    return [b.seq_hash for e in events for b in e.stored]


def _tr(**kw):
    return KvTranslator("w1", 0, block_size=BS, metrics=KvPublisherMetrics(), **kw)


def test_same_tokens_same_router_hashes_regardless_of_vllm_hashes():
    toks = list(range(12))
    a, b = _tr(), _tr()
    ea = a.translate(_batch(_store(toks, [1, 2, 3])))
    eb = b.translate(_batch(_store(toks, [b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32])))
    assert _seqs(ea) == _seqs(eb) == hashing.sequence_hashes(toks, BS)
    assert [(x.seq_hash, x.parent) for x in ea[0].stored][1][1] == ea[0].stored[0].seq_hash


def test_continuation_chains_through_parent():
    toks = list(range(20))
    t = _tr()
    e1 = t.translate(_batch(_store(toks[:8], [11, 12])))
    e2 = t.translate(_batch(_store(toks[8:20], [13, 14, 15], parent=12)))
    assert _seqs(e1) + _seqs(e2) == hashing.sequence_hashes(toks, BS)
    assert e2[0].stored[0].parent == e1[0].stored[-1].seq_hash
    assert [e.event_id for e in e1 + e2] == [0, 1]


def test_removed_and_cleared_and_unknown():
    t = _tr()
    t.translate(_batch(_store(list(range(8)), [1, 2])))
    seqs = hashing.sequence_hashes(list(range(8)), BS)
    out = t.translate(_batch(ve.removed([2, 99])))
    assert out[0].kind == "removed" and out[0].removed == [seqs[1]]
    assert t.metrics.unknown_removals._value.get() == 1
    assert t.translate(_batch(ve.removed([99]))) == []  # nothing known: no event, no id burnt
    assert t.num_blocks() == 1
    out = t.translate(_batch(ve.AllBlocksCleared()))
    assert out[0].kind == "cleared" and out[0].event_id == 2 and t.num_blocks() == 0


def test_restore_same_hash_is_idempotent():
    t = _tr()
    t.translate(_batch(_store(list(range(4)), [1])))
    t.translate(_batch(_store(list(range(4)), [1])))
    assert t.num_blocks() == 1
    out = t.translate(_batch(ve.removed([1])))
    assert len(out[0].removed) == 1 and t.num_blocks() == 0


def test_orphan_parent_dropped_and_counted():
    t = _tr()
    assert t.translate(_batch(_store(list(range(4)), [5], parent=404))) == []
    assert t.metrics.orphans._value.get() == 1
    assert t.last_event_id == -1


def test_block_size_mismatch_is_loud(caplog):
    t = _tr()
    with caplog.at_level(logging.WARNING):
        out = t.translate(_batch(_store(list(range(16)), [1, 2], block_size=8)))
        t.translate(_batch(_store(list(range(100, 116)), [3, 4], block_size=8)))
    assert out[0].block_size == 8
    assert _seqs(out) == hashing.sequence_hashes(list(range(16)), 8)
    assert t.metrics.block_size_mismatch._value.get() == 2
    msgs = [r.getMessage() for r in caplog.records if "block size 8" in r.getMessage()]
    assert len(msgs) == 1  # warned once, counted every time


def test_lora_salt_and_unreproducible_extras():
    toks = list(range(8))
    t = _tr()
    lora = t.translate(_batch(_store(toks, [1, 2], lora_name="ad", lora_id=1,
                                     extra_keys=[("ad",), ("ad",)])))
    assert _seqs(lora) == hashing.sequence_hashes(toks, BS, lora_name="ad")
    assert lora[0].lora_name == "ad"
    salted = t.translate(_batch(_store(toks, [3, 4], extra_keys=[("s1",), None])))
    assert _seqs(salted) == hashing.sequence_hashes(toks, BS, salt="s1")
    # the salt seed is inherited by a continuation (vLLM only puts the salt on the first block)
    cont = t.translate(_batch(_store(list(range(8, 12)), [5], parent=4)))
    assert _seqs(cont) == hashing.sequence_hashes(list(range(12)), BS, salt="s1")[2:]
    mm = t.translate(_batch(_store(toks, [6, 7], extra_keys=[(("img", 0),), None])))
    assert not set(_seqs(mm)) & set(hashing.sequence_hashes(toks, BS))  # never a false hit


def test_identity_adapter_blocks_are_base_blocks():
    """vLLM-CPU's mixed-batch workaround runs base requests through an internal identity adapter;
    their blocks hold the base model's KV and must get base router hashes (and no LoRA name)."""
    from actors.engines.identity_lora import IDENTITY_LORA_NAME as ID

    toks = list(range(12))
    t = _tr()
    ev = t.translate(_batch(_store(toks[:8], [1, 2], lora_name=ID, lora_id=2**31 - 1,
                                   extra_keys=[(ID,), (ID,)])))
    assert _seqs(ev) == hashing.sequence_hashes(toks[:8], BS) and ev[0].lora_name is None
    cont = t.translate(_batch(_store(toks[8:], [3], parent=2, lora_name=ID, lora_id=2**31 - 1,
                                     extra_keys=[(ID,)])))
    assert _seqs(cont) == hashing.sequence_hashes(toks, BS)[2:]
    salted = t.translate(_batch(_store(toks[:4], [4], lora_name=ID, extra_keys=[(ID, "s1")])))
    assert _seqs(salted) == hashing.sequence_hashes(toks[:4], BS, salt="s1")


def test_other_medium_and_group_skipped():
    t = _tr()
    assert t.translate(_batch(_store(list(range(4)), [1], medium="CPU"))) == []
    assert t.translate(_batch(_store(list(range(4)), [1], group_idx=1))) == []
    assert t.metrics.skipped._value.get() == 2


def test_zmq_gap_counted(caplog):
    t = _tr()
    t.translate(_batch(), seq=0)
    t.translate(_batch(), seq=1)
    with caplog.at_level(logging.WARNING):
        t.translate(_batch(), seq=5)
    assert t.metrics.zmq_gaps._value.get() == 1 and "jumped" in caplog.text


def test_range_and_snapshot():
    t = _tr(ring_size=3)
    for i in range(5):
        t.translate(_batch(_store(list(range(i * 4, i * 4 + 4)), [100 + i])))
    r = t.range(3)
    assert r.complete and [e.event_id for e in r.events] == [3, 4] and r.last_event_id == 4
    r = t.range(2, 3)
    assert r.complete and [e.event_id for e in r.events] == [2, 3]
    r = t.range(0)
    assert not r.complete and r.first_event_id == 2
    assert t.range(5).complete and t.range(5).events == []
    snap = t.snapshot()
    assert snap.last_event_id == 4 and len(snap.blocks) == 5 and snap.block_size == BS


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=BS, max_size=BS * 12), st.randoms(use_true_random=False))
def test_any_split_into_events_gives_frontend_hashes(tokens, rnd):
    """However vLLM splits a sequence into BlockStored events, the router hashes equal the frontend's."""
    n = len(tokens) // BS
    vh = [_opaque(rnd) for _ in range(n)]
    t = _tr()
    out = []
    i = 0
    while i < n:
        k = rnd.randint(1, n - i)
        out += t.translate(_batch(_store(tokens[i * BS:(i + k) * BS], vh[i:i + k],
                                         parent=vh[i - 1] if i else None)))
        i += k
    assert _seqs(out) == hashing.sequence_hashes(tokens, BS)
    assert [e.event_id for e in out] == list(range(len(out)))


def test_random_seed_independence():
    rng = random.Random(3)
    toks = [rng.randrange(2000) for _ in range(64)]
    a = _seqs(_tr().translate(_batch(_store(toks, [_opaque(rng) for _ in range(16)]))))
    assert a == hashing.sequence_hashes(toks, BS)
