"""Byte-level identity with vllm.distributed.kv_events (skipped where vllm is not installed)."""

import pytest

from actors.engines import kv_events as ve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
kv = pytest.importorskip("vllm.distributed.kv_events")


def _pairs():
    ours = ve.KVEventBatch(ts=12.25, events=[
        ve.BlockStored(block_hashes=[1, b"\x02" * 32], parent_block_hash=None, token_ids=list(range(8)),
                       block_size=4, lora_id=1, medium="GPU", lora_name="a",
                       extra_keys=[("a",), ("a", "salt")], group_idx=0, kv_cache_spec_kind="full_attention"),
        ve.BlockRemoved(block_hashes=[1], medium="GPU"),
        ve.AllBlocksCleared()], data_parallel_rank=1)
    theirs = kv.KVEventBatch(ts=12.25, events=[
        kv.BlockStored(block_hashes=[1, b"\x02" * 32], parent_block_hash=None, token_ids=list(range(8)),
                       block_size=4, lora_id=1, medium="GPU", lora_name="a",
                       extra_keys=[("a",), ("a", "salt")], group_idx=0, kv_cache_spec_kind="full_attention"),
        kv.BlockRemoved(block_hashes=[1], medium="GPU"),
        kv.AllBlocksCleared()], data_parallel_rank=1)
    return ours, theirs


def test_bytes_identical_both_ways():
    import msgspec

    ours, theirs = _pairs()
    enc = msgspec.msgpack.Encoder()
    assert ve.encode_batch(ours) == enc.encode(theirs)
    back = msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(ve.encode_batch(ours))
    assert back == theirs
    assert ve.decode_batch(enc.encode(theirs)) == ours
