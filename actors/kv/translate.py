"""Logic of the KV publisher: vLLM event batches → numbered router events, plus a local index.

One :class:`KvTranslator` per (instance, dp_rank). It

* recomputes a router sequence hash for every stored block from the block's tokens
  (actors.kv.hashing), because vLLM's hashes are opaque (sha256-based, salted by vLLM's config)
  and the frontend cannot recompute them;
* keeps ``vLLM hash → router seq hash`` so that ``BlockRemoved`` (which only carries vLLM
  hashes) and the ``parent_block_hash`` of a continuation can be translated;
* numbers the router events from 0;
* keeps the current blocks (for ``dump``) and a ring buffer of recent events (for ``range``);
* flags a block size different from the configured one loudly (warning once + counter).

Extra keys: vLLM gives each block ``None`` or a tuple of items: the LoRA name first (with a LoRA),
then one ``(identifier, offset in the block)`` pair per image touching the block (a 2-list once
msgpack decoded it), the cache salt (first block of a prompt only), a prompt-embeddings digest
(bytes). The LoRA name and the salt make the chain's seed (``hashing.hash_seed``): the salt appears
only on the first block, so the seed of a chain is remembered per vLLM hash and inherited by
continuations. Image pairs fold into their own block's hash with ``hashing.fold_mm``, as the
frontend folds its requests' images, so image blocks match; they need no state (each block carries
its own pairs, offsets relative to it). Anything else (prompt-embedding digests, shapes we do not
know) is folded by its ``repr``: the seed when on a prompt's first block, else that block's hash;
such blocks never match a lookup, which is a miss, never a false hit.

Filtering: only the device tier (``medium`` None or "GPU") and the full-attention group
(``group_idx`` None or 0) are indexed; offload tiers and sliding-window groups would otherwise
claim blocks the engine cannot reuse for a prefix hit.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import NamedTuple

import msgspec
import xxhash
from prometheus_client import CollectorRegistry, Counter

from actors.engines.identity_lora import IDENTITY_LORA_NAME
from actors.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
)
from actors.kv import hashing
from actors.kv.contract import (
    CLEARED,
    REMOVED,
    STORED,
    KvRangeReply,
    KvSnapshot,
    RouterKvEvent,
    StoredBlock,
)

log = logging.getLogger(__name__)

_DEVICE_MEDIA = (None, "GPU")
_I64 = 1 << 63  # image offsets are folded as i64: anything beyond is no vLLM offset


class KvPublisherMetrics:
    """Counters of the KV publisher; pass the registry the worker's /metrics exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.events = Counter("vllm_actors_kv_publisher_events_total", "Router KV events produced",
                              ["kind"], registry=reg)
        self.block_size_mismatch = Counter(
            "vllm_actors_kv_publisher_block_size_mismatch_total",
            "BlockStored events whose block size differs from the configured one", registry=reg)
        self.orphans = Counter(
            "vllm_actors_kv_publisher_orphan_blocks_total",
            "Stored blocks dropped because their parent was unknown", registry=reg)
        self.unknown_removals = Counter(
            "vllm_actors_kv_publisher_unknown_removals_total",
            "Removed vLLM hashes that were never seen stored", registry=reg)
        self.skipped = Counter("vllm_actors_kv_publisher_skipped_events_total",
                               "vLLM events ignored (other medium/group)", registry=reg)
        self.zmq_gaps = Counter("vllm_actors_kv_publisher_zmq_gaps_total",
                                "Gaps in vLLM's ZMQ sequence numbers", registry=reg)


class KvTranslator:
    def __init__(self, instance: str, dp_rank: int = 0, *, block_size: int,
                 ring_size: int = 10_000, metrics: KvPublisherMetrics | None = None,
                 epoch: int | None = None) -> None:
        self.instance = instance
        self.epoch = time.time_ns() if epoch is None else epoch
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.metrics = metrics or KvPublisherMetrics()
        self._next_id = 0
        self._ring: deque[RouterKvEvent] = deque(maxlen=ring_size)
        # vLLM hash -> router seq hash, and the seed of that chain when it is not plain LoRA/1337
        self._map: dict[ExternalBlockHash, int] = {}
        self._chain_seed: dict[ExternalBlockHash, int] = {}
        # current blocks (router seq hash -> block) and how many vLLM hashes name each one
        self._blocks: dict[int, StoredBlock] = {}
        self._refs: dict[int, int] = {}
        self._warned_block_size: set[int] = set()
        self.last_zmq_seq: int | None = None

    # ---- feeding -----------------------------------------------------------------------------
    def translate(self, batch: KVEventBatch, seq: int | None = None) -> list[RouterKvEvent]:
        """Apply one vLLM batch; return the router events to publish (in order)."""
        if seq is not None:
            if self.last_zmq_seq is not None and seq != self.last_zmq_seq + 1:
                self.metrics.zmq_gaps.inc()
                log.warning("KV events %s/%d: vLLM ZMQ seq jumped %d -> %d; the index may miss "
                            "changes until replayed", self.instance, self.dp_rank,
                            self.last_zmq_seq, seq)
            self.last_zmq_seq = seq
        out: list[RouterKvEvent] = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                r = self._stored(ev, batch.ts)
            elif isinstance(ev, BlockRemoved):
                r = self._removed(ev, batch.ts)
            elif isinstance(ev, AllBlocksCleared):
                r = self._cleared(batch.ts)
            else:
                # Not our decoder's classes (e.g. vLLM's own, or a newer event type): never drop
                # silently, the index would quietly diverge.
                self.metrics.skipped.inc()
                log.warning("KV events %s/%d: unknown event %s ignored", self.instance, self.dp_rank,
                            type(ev).__name__)
                r = None
            if r is not None:
                out.append(r)
        return out

    def _emit(self, kind: str, ts: float, block_size: int, *, stored: list[StoredBlock] | None = None,
              removed: list[int] | None = None, lora_name: str | None = None) -> RouterKvEvent:
        ev = RouterKvEvent(instance=self.instance, dp_rank=self.dp_rank, event_id=self._next_id,
                           kind=kind, block_size=block_size, stored=stored or [],  # type: ignore[arg-type]
                           removed=removed or [], lora_name=lora_name, ts=ts or time.time(),
                           epoch=self.epoch)
        self._next_id += 1
        self._ring.append(ev)
        self.metrics.events.labels(kind).inc()
        return ev

    def _check_block_size(self, bs: int) -> None:
        if bs != self.block_size:
            self.metrics.block_size_mismatch.inc()
            if bs not in self._warned_block_size:
                self._warned_block_size.add(bs)
                log.warning("KV events %s/%d: engine block size %d differs from the configured %d; "
                            "routers using %d will never match these blocks", self.instance,
                            self.dp_rank, bs, self.block_size, self.block_size)

    def _seed_for(self, ev: BlockStored, parent_seed: int | None, first: _Extras | None) -> int:
        if parent_seed is not None:
            return parent_seed
        if first is None:
            return hashing.hash_seed(ev.lora_name, None)
        seed = hashing.hash_seed(ev.lora_name, first.salt)
        if first.other:
            seed = xxhash.xxh3_64_intdigest(repr(first.other).encode(), seed)  # unreproducible
        return seed

    def _stored(self, ev: BlockStored, ts: float) -> RouterKvEvent | None:
        if ev.medium not in _DEVICE_MEDIA or ev.group_idx not in (None, 0):
            self.metrics.skipped.inc()
            return None
        if ev.lora_name == IDENTITY_LORA_NAME:
            ev = _as_base(ev)
        bs = ev.block_size
        self._check_block_size(bs)
        n = len(ev.block_hashes)
        if n == 0:
            return None
        if len(ev.token_ids) != n * bs:
            log.error("KV events %s/%d: BlockStored with %d hashes but %d tokens (block size %d); "
                      "dropped", self.instance, self.dp_rank, n, len(ev.token_ids), bs)
            self.metrics.orphans.inc(n)
            return None
        parent_seq: int | None = None
        parent_seed: int | None = None
        if ev.parent_block_hash is not None:
            parent_seq = self._map.get(ev.parent_block_hash)
            if parent_seq is None:
                # We cannot chain without the parent's prefix (e.g. we started after it was stored).
                self.metrics.orphans.inc(n)
                log.warning("KV events %s/%d: parent of %d stored blocks unknown; dropped",
                            self.instance, self.dp_rank, n)
                return None
            parent_seed = self._chain_seed.get(ev.parent_block_hash)
        # Per block: image pairs (any block), then the salt and the unreproducible rest of a
        # prompt's first block go to the seed, those of any other block to that block's hash.
        fresh = parent_seq is None  # these blocks start a prompt: its first block is extras[0]
        extras = [_parse_extras(k, ev.lora_name, first=fresh and i == 0)
                  for i, k in enumerate((ev.extra_keys or [])[:n])]
        seed = self._seed_for(ev, parent_seed, extras[0] if fresh and extras else None)
        bhashes = hashing.block_hashes_seeded(ev.token_ids, bs, seed)
        for i, ex in enumerate(extras):
            if ex is None:
                continue
            if ex.mm:
                bhashes[i] = hashing.fold_mm(bhashes[i], ex.mm, seed)
            if ex.other and not (fresh and i == 0):
                bhashes[i] = xxhash.xxh3_64_intdigest(repr(ex.other).encode(), bhashes[i])
        seqs = hashing.chain_hashes(bhashes, seed, parent_seq)
        base_seed = hashing.hash_seed(ev.lora_name, None)
        blocks: list[StoredBlock] = []
        prev = parent_seq
        for vh, sh in zip(ev.block_hashes, seqs, strict=True):
            old = self._map.get(vh)
            if old != sh:
                if old is not None:
                    self._unref(old)
                self._map[vh] = sh
                self._refs[sh] = self._refs.get(sh, 0) + 1
            if seed != base_seed:
                self._chain_seed[vh] = seed
            blk = StoredBlock(sh, prev)
            self._blocks[sh] = blk
            blocks.append(blk)
            prev = sh
        return self._emit(STORED, ts, bs, stored=blocks, lora_name=ev.lora_name)

    def _unref(self, sh: int) -> bool:
        c = self._refs.get(sh, 0) - 1
        if c > 0:
            self._refs[sh] = c
            return False
        self._refs.pop(sh, None)
        self._blocks.pop(sh, None)
        return True

    def _removed(self, ev: BlockRemoved, ts: float) -> RouterKvEvent | None:
        if ev.medium not in _DEVICE_MEDIA or ev.group_idx not in (None, 0):
            self.metrics.skipped.inc()
            return None
        gone: list[int] = []
        for vh in ev.block_hashes:
            sh = self._map.pop(vh, None)
            self._chain_seed.pop(vh, None)
            if sh is None:
                self.metrics.unknown_removals.inc()
                continue
            if self._unref(sh):
                gone.append(sh)
        if not gone:
            return None
        return self._emit(REMOVED, ts, self.block_size, removed=gone)

    def _cleared(self, ts: float) -> RouterKvEvent:
        self._map.clear()
        self._chain_seed.clear()
        self._blocks.clear()
        self._refs.clear()
        return self._emit(CLEARED, ts, self.block_size)

    # ---- queries -----------------------------------------------------------------------------
    @property
    def last_event_id(self) -> int:
        return self._next_id - 1

    def num_blocks(self) -> int:
        return len(self._blocks)

    def snapshot(self) -> KvSnapshot:
        """Current blocks (dict order keeps parents before children) for a ``dump`` reply."""
        return KvSnapshot(dp_rank=self.dp_rank, block_size=self.block_size,
                          last_event_id=self.last_event_id, blocks=list(self._blocks.values()),
                          epoch=self.epoch)

    def range(self, start_event_id: int, end_event_id: int | None = None) -> KvRangeReply:
        """Buffered events ``start <= id <= end`` for a ``range`` reply."""
        first = self._ring[0].event_id if self._ring else -1
        last = self.last_event_id
        end = last if end_event_id is None else min(end_event_id, last)
        complete = start_event_id > last or (first != -1 and start_event_id >= first)
        events: list[RouterKvEvent] = []
        if self._ring and start_event_id <= end:
            lo = max(start_event_id, first) - first  # ids in the ring are consecutive
            hi = end - first
            events = [self._ring[i] for i in range(lo, hi + 1)]
        return KvRangeReply(instance=self.instance, dp_rank=self.dp_rank, events=events,
                            complete=complete, first_event_id=first, last_event_id=last)


def _as_base(ev: BlockStored) -> BlockStored:
    """Blocks of base requests the engine ran through its internal identity adapter (the vLLM-CPU
    mixed-batch workaround, actors/engines/identity_lora.py) hold exactly the base model's KV: name
    them as base blocks, or base prompts would never match them in the router."""
    extra = [None if (items := _extras_without_lora(k, IDENTITY_LORA_NAME)) == () else items
             for k in (ev.extra_keys or [])]
    return msgspec.structs.replace(ev, lora_name=None, lora_id=None,
                                   extra_keys=extra if ev.extra_keys is not None else None)


class _Extras(NamedTuple):
    """One block's extra keys, sorted by what they mean to the router hash."""

    mm: list[hashing.MmKey]  # (identifier, offset in the block) per image, in vLLM's order
    salt: str | None  # the cache salt (a prompt's first block only)
    other: tuple  # what tokens cannot reproduce (prompt-embedding digests, unknown shapes)


def _parse_extras(extra: object, lora_name: str | None, *, first: bool) -> _Extras | None:
    """A block's extra keys minus the LoRA name, sorted (None when nothing is left).

    On a prompt's first block, a lone bare string is the cache salt (vLLM: LoRA name, image pairs,
    salt, embeddings digest); two are ambiguous, and a string elsewhere unknown: unreproducible."""
    items = _extras_without_lora(extra, lora_name)
    if not items:
        return None
    mm: list[hashing.MmKey] = []
    strs: list[str] = []
    other: list[object] = []
    for it in items:
        if (isinstance(it, list | tuple) and len(it) == 2 and isinstance(it[0], str)
                and type(it[1]) is int and -_I64 <= it[1] < _I64):
            mm.append((it[0], it[1]))
        elif isinstance(it, str):
            strs.append(it)
        else:
            other.append(it)
    salt = None
    if first and len(strs) == 1:
        salt = strs[0]
    else:
        other += strs
    return _Extras(mm, salt, tuple(other))


def _extras_without_lora(extra: object, lora_name: str | None) -> tuple:
    """A block's extra keys minus the leading LoRA name (which the seed already covers)."""
    if not extra:
        return ()
    items = tuple(extra) if isinstance(extra, list | tuple) else (extra,)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    return items
