"""Router-facing KV event contract (msgpack on ``ns.kv.events.<instance>``; JSON also decodes).

A message holds one event, or, with the header ``Kv-Batch: <n>``, an array of n events in event-id
order: what one engine step changed travels as one message (``encode_batch``, ``decode_events``).

The KV publisher turns vLLM's opaque events into these: every block is named by its router
*sequence hash* (actors.kv.hashing), which any frontend can recompute from prompt tokens. Events
are numbered per (instance, dp_rank) from 0 so a router can detect a gap and recover through the
publisher's index endpoints (``Subjects.kv_index(instance, "range" | "dump")``):

* ``range`` (:class:`KvRangeRequest` → :class:`KvRangeReply`): the events with
  ``start_event_id <= id <= end_event_id`` from the publisher's ring buffer. ``complete`` is False
  when the buffer no longer reaches back to ``start_event_id``: the caller must then ``dump``.
* ``dump`` (:class:`KvDumpRequest` → :class:`KvDumpReply`): the current blocks per DP rank and
  the id of the last event they include.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from bus import subjects as S

EventKind = Literal["stored", "removed", "cleared"]
STORED: EventKind = "stored"
REMOVED: EventKind = "removed"
CLEARED: EventKind = "cleared"


class StoredBlock(msgspec.Struct, array_like=True, gc=False):
    """``[seq_hash, parent_seq_hash]``; the parent is None for the first block of a sequence."""

    seq_hash: int
    parent: int | None = None


class RouterKvEvent(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One KV change of one (instance, dp_rank), as the router consumes it."""

    instance: str
    dp_rank: int = 0
    event_id: int
    kind: EventKind
    block_size: int
    stored: list[StoredBlock] = []
    removed: list[int] = []
    lora_name: str | None = None
    ts: float = 0.0
    # Incarnation of the publisher (its start time in ns): ids restart at 0 when it restarts, and a
    # router that sees a new epoch drops what it knew about this worker instead of ignoring the
    # "old" ids as duplicates.
    epoch: int = 0

    @property
    def worker(self) -> tuple[str, int]:
        return (self.instance, self.dp_rank)


class KvRangeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    dp_rank: int = 0
    start_event_id: int
    end_event_id: int | None = None  # inclusive; None = up to the latest


class KvRangeReply(msgspec.Struct, kw_only=True):
    instance: str
    dp_rank: int
    events: list[RouterKvEvent]
    complete: bool  # False: the ring buffer starts after start_event_id; use dump
    first_event_id: int  # oldest id still buffered (-1 when empty)
    last_event_id: int  # newest id published (-1 when none)


class KvDumpRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    dp_rank: int | None = None  # None = every rank


class KvSnapshot(msgspec.Struct, kw_only=True):
    """Blocks a (instance, dp_rank) holds after event ``last_event_id`` (-1: no event yet)."""

    dp_rank: int
    block_size: int
    last_event_id: int
    blocks: list[StoredBlock]  # parents before children
    epoch: int = 0


class KvDumpReply(msgspec.Struct, kw_only=True):
    instance: str
    snapshots: list[KvSnapshot]


_enc = msgspec.msgpack.Encoder()
_event_dec = msgspec.msgpack.Decoder(type=RouterKvEvent)


def encode_event(event: RouterKvEvent) -> bytes:
    return _enc.encode(event)


def decode_event(data: bytes) -> RouterKvEvent:
    return _event_dec.decode(data)


_batch_dec = msgspec.msgpack.Decoder(type=list[RouterKvEvent])
_json_event_dec = msgspec.json.Decoder(type=RouterKvEvent)
_json_batch_dec = msgspec.json.Decoder(type=list[RouterKvEvent])


def encode_batch(encoded: list[bytes]) -> bytes:
    """A msgpack array of already encoded events (``encode_event``), without encoding them again."""
    return _enc.encode([msgspec.Raw(e) for e in encoded])


def decode_events(data: bytes, headers: Mapping[str, str] | None) -> list[RouterKvEvent]:
    """The events of one message on ``ns.kv.events.<instance>``: an array when the message says
    ``Kv-Batch``, else one event; msgpack unless its Content-Type says JSON (``nats pub`` by hand).
    Raises msgspec's DecodeError/ValidationError for anything else."""
    h = headers or {}
    msgpack = h.get(S.CONTENT_TYPE) == S.CT_MSGPACK
    if S.KV_BATCH in h:
        return (_batch_dec if msgpack else _json_batch_dec).decode(data)
    return [(_event_dec if msgpack else _json_event_dec).decode(data)]
