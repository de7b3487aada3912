"""vLLM's ZMQ KV-event wire format, decoded and encoded without importing vllm.

The Structs below are wire-identical to ``vllm.distributed.kv_events`` (vllm 0.32): same field
names, order, required fields, defaults, ``omit_defaults`` and ``tag=True`` (tag field ``"type"``,
value = class name). ``tests/kv/test_kv_vllm_wire.py`` checks byte equality against vllm's own
encoder when vllm is importable. This module is the canonical decoder for the KV publisher and the
canonical encoder for the mocker engine (which must look exactly like vLLM on the wire).

ZMQ framing (PUB socket): ``[topic, seq (8-byte big-endian, from 0, +1 per batch), payload]``.
Replay (DEALER → vLLM's ROUTER): send ``[b"", seq_be8]``; receive ``[b"", topic, seq_be8, payload]``
per buffered batch with seq ≥ start, then the end marker ``[b"", b"", (-1 as signed be8), b""]``.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's ExternalBlockHash: a u64 int by default, the 32-byte sha256 digest with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0. Opaque to us: only used to match later removals.
ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
DEFAULT_TOPIC = "kv-events"
REPLAY_END_SEQ = -1


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union (tag field ``"type"``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, still required on the wire
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


VllmKvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Payload ``[ts, [events...], data_parallel_rank]`` (rank is nil when None, as in vLLM)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def stored(block_hashes: list[ExternalBlockHash], token_ids: list[int], block_size: int, *,
           parent_block_hash: ExternalBlockHash | None = None, lora_name: str | None = None,
           lora_id: int | None = None, medium: str | None = MEDIUM_GPU,
           extra_keys: list[tuple[Any, ...] | None] | None = None,
           group_idx: int | None = 0, kv_cache_spec_kind: str | None = "full_attention") -> BlockStored:
    """A ``BlockStored`` filled the way vLLM 0.32 fills it (for the mocker and tests)."""
    return BlockStored(block_hashes=block_hashes, parent_block_hash=parent_block_hash,
                       token_ids=token_ids, block_size=block_size, lora_id=lora_id, medium=medium,
                       lora_name=lora_name, extra_keys=extra_keys, group_idx=group_idx,
                       kv_cache_spec_kind=kv_cache_spec_kind)


def removed(block_hashes: list[ExternalBlockHash], medium: str | None = MEDIUM_GPU,
            group_idx: int | None = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=medium, group_idx=group_idx)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload; raises ``msgspec.DecodeError``/``ValidationError`` on bad input."""
    return _decoder.decode(payload)


def encode_message(batch: KVEventBatch, seq: int, topic: str = DEFAULT_TOPIC) -> list[bytes]:
    """The 3 PUB frames vLLM sends for one batch."""
    return [topic.encode(), seq.to_bytes(8, "big"), encode_batch(batch)]


def decode_message(frames: list[bytes]) -> tuple[str, int, KVEventBatch]:
    """``(topic, seq, batch)`` from the 3 PUB frames (or the last 3 frames of a replay reply)."""
    if len(frames) < 3:
        raise ValueError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_b, payload = frames[-3:]
    return topic.decode(), int.from_bytes(seq_b, "big", signed=True), decode_batch(payload)


def replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to vLLM's replay ROUTER to get batches with seq >= start_seq."""
    return [b"", start_seq.to_bytes(8, "big")]


def is_replay_end(frames: list[bytes]) -> bool:
    """True for the replay end marker ``[b"", b"", -1 (signed be8), b""]``."""
    return (len(frames) >= 3 and frames[-1] == b""
            and int.from_bytes(frames[-2], "big", signed=True) == REPLAY_END_SEQ)
