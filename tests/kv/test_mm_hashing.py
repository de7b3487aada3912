"""Image-aware router hashes: vLLM's per-block image keys, folded alike by the frontend's hashing and
the KV publisher's reading of vLLM-shaped ``BlockStored`` events (decoded from msgpack, as on the wire)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.engines import kv_events as ve
from actors.engines.protocol import ImageInput, MultiModalInput
from actors.kv import hashing
from actors.kv.hashing import MmSpan
from actors.kv.translate import KvPublisherMetrics, KvTranslator

BS = 8
IMG_A = "a" * 64
IMG_B = "b" * 64


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def _tr() -> KvTranslator:
    return KvTranslator("w1", 0, block_size=BS, metrics=KvPublisherMetrics())


def _wire(*events: ve.BlockStored) -> ve.KVEventBatch:
    """Through msgpack and back, so image pairs arrive as 2-lists, as vLLM's tuples do."""
    return ve.decode_batch(ve.encode_batch(ve.KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=0)))


def _seqs(events) -> list[int]:
    return [b.seq_hash for e in events for b in e.stored]


def test_block_keys_follow_vllms_rule():
    # image A covers tokens [5, 38): blocks 0..4 (8 tokens each); image B [38, 42) starts in block 4
    spans = [MmSpan(IMG_A, 5, 33), MmSpan(IMG_B, 38, 4)]
    keys = hashing.mm_block_keys(spans, BS, 7)
    assert keys == [((IMG_A, 5),), ((IMG_A, -3),), ((IMG_A, -11),), ((IMG_A, -19),),
                    ((IMG_A, -27), (IMG_B, 6)), ((IMG_B, -2),), ()]
    assert hashing.mm_block_keys([], BS, 2) == [(), ()]
    assert hashing.mm_block_keys(spans, BS, 0) == []


def test_mm_spans_of_a_request():
    mm = MultiModalInput(images=[ImageInput(uuid=IMG_A, data=b"x"), ImageInput(uuid=IMG_B, data=b"y")],
                         source_ids=[1, 2, 3], prompt_len=60, placeholders=[(5, 33), (40, 4)])
    assert hashing.mm_spans(mm) == [MmSpan(IMG_A, 5, 33), MmSpan(IMG_B, 40, 4)]
    assert hashing.mm_spans(None) is None


def test_fold_changes_only_the_image_blocks_and_what_follows():
    toks = _tokens(48)
    plain = hashing.sequence_hashes(toks, BS)
    a = hashing.sequence_hashes(toks, BS, mm=[MmSpan(IMG_A, 17, 10)])  # blocks 2 and 3
    b = hashing.sequence_hashes(toks, BS, mm=[MmSpan(IMG_B, 17, 10)])
    moved = hashing.sequence_hashes(toks, BS, mm=[MmSpan(IMG_A, 18, 10)])
    assert a[:2] == plain[:2] == b[:2] == moved[:2]  # the text before the image is shared
    assert not set(a[2:]) & set(plain[2:]) and not set(a[2:]) & set(b[2:]) and not set(a[2:]) & set(moved[2:])
    assert hashing.sequence_hashes(toks, BS, mm=[]) == plain
    blocks = hashing.block_hashes(toks, BS)
    assert a[2] == hashing.chain_hashes(
        blocks[:2] + [hashing.fold_mm(blocks[2], [(IMG_A, 1)], hashing.SEED)])[2]


def test_translator_matches_the_frontend_rule_with_continuation():
    """A first event for blocks 0-2 and a continuation (parent hash) for blocks 3-5 whose keys have
    negative offsets: the router hashes are the frontend's for the whole expanded prompt."""
    toks = _tokens(48, 1)
    spans = [MmSpan(IMG_A, 5, 33), MmSpan(IMG_B, 38, 4)]
    keys = hashing.mm_block_keys(spans, BS, 6)
    extra = [k or None for k in keys]
    t = _tr()
    first = t.translate(_wire(ve.stored([11, 12, 13], toks[:24], BS, extra_keys=extra[:3])))
    cont = t.translate(_wire(ve.stored([14, 15, 16], toks[24:], BS, parent_block_hash=13,
                                       extra_keys=extra[3:])))
    ev = _wire(ve.stored([14], toks[24:32], BS, extra_keys=extra[3:4])).events[0]
    assert ev.extra_keys == [([IMG_A, -19],)]  # what msgpack hands the translator
    assert _seqs(first) + _seqs(cont) == hashing.sequence_hashes(toks, BS, mm=spans)


def test_different_image_and_no_image_never_match():
    toks = _tokens(32, 2)
    spans = [MmSpan(IMG_A, 3, 20)]
    t = _tr()
    got = _seqs(t.translate(_wire(ve.stored([1, 2, 3, 4], toks, BS, extra_keys=[
        ((IMG_A, 3),), ((IMG_A, -5),), ((IMG_A, -13),), None]))))
    assert got == hashing.sequence_hashes(toks, BS, mm=spans)
    assert not set(got) & set(hashing.sequence_hashes(toks, BS, mm=[MmSpan(IMG_B, 3, 20)]))
    assert not set(got) & set(hashing.sequence_hashes(toks, BS))  # same text, no image


@pytest.mark.parametrize("lora, salt", [("ad", None), (None, "s1"), ("ad", "s1")])
def test_lora_and_salt_with_an_image(lora, salt):
    """vLLM's order in a block's keys: LoRA name, image pairs, then the salt (first block only)."""
    toks = _tokens(40, 3)
    spans = [MmSpan(IMG_A, 2, 12)]  # blocks 0 and 1

    def keys(i: int, mm: tuple) -> tuple | None:
        items = ((lora,) if lora else ()) + mm + ((salt,) if salt and i == 0 else ())
        return items or None

    extra = [keys(0, ((IMG_A, 2),)), keys(1, ((IMG_A, -6),)), keys(2, ())]
    t = _tr()
    first = t.translate(_wire(ve.stored([1, 2, 3], toks[:24], BS, lora_name=lora, lora_id=1 if lora else None,
                                        extra_keys=extra)))
    cont = t.translate(_wire(ve.stored([4, 5], toks[24:], BS, parent_block_hash=3, lora_name=lora,
                                       lora_id=1 if lora else None, extra_keys=[keys(3, ()), keys(4, ())])))
    want = hashing.sequence_hashes(toks, BS, lora_name=lora, salt=salt, mm=spans)
    assert _seqs(first) + _seqs(cont) == want
    assert want != hashing.sequence_hashes(toks, BS, lora_name=lora, salt=salt)
    assert want[0] != hashing.sequence_hashes(toks, BS, mm=spans)[0]


def test_unknown_items_still_never_match():
    toks = _tokens(16, 4)
    t = _tr()
    digest = t.translate(_wire(ve.stored([1, 2], toks, BS, extra_keys=[(b"\x01" * 32,), (b"\x02" * 32,)])))
    assert not set(_seqs(digest)) & set(hashing.sequence_hashes(toks, BS))
    # a later block's unknown item (a bare string past the first block, a pair of the wrong shape)
    odd = _tr().translate(_wire(ve.stored([1, 2], toks, BS, extra_keys=[None, ("x",)])))
    assert _seqs(odd)[0] == hashing.sequence_hashes(toks, BS)[0]
    assert _seqs(odd)[1] != hashing.sequence_hashes(toks, BS)[1]
    bad = _tr().translate(_wire(ve.stored([1, 2], toks, BS, extra_keys=[([IMG_A, 2**64 - 1],), None])))
    assert not set(_seqs(bad)) & set(hashing.sequence_hashes(toks, BS, mm=[MmSpan(IMG_A, 0, 4)]))


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 30)), max_size=5), st.integers(1, 16))
def test_keys_list_exactly_the_overlapping_images(gaps_lengths, bs):
    """Property: for spans in prompt order, a block's keys are the images overlapping it, in order."""
    spans, pos = [], 0
    for i, (gap, n) in enumerate(gaps_lengths):
        spans.append(MmSpan(f"i{i}", pos + gap, n))
        pos += gap + n
    n_blocks = pos // bs + 2
    keys = hashing.mm_block_keys(spans, bs, n_blocks)
    for b in range(n_blocks):
        s, e = b * bs, (b + 1) * bs
        assert keys[b] == tuple((sp.identifier, sp.offset - s) for sp in spans
                                if sp.offset < e and sp.offset + sp.length > s)
