"""The router's KV index: which (instance, dp_rank) holds which block, fed by KV events.

Design: a **flat dict keyed by sequence hash** is the radix tree. A sequence hash chains every
block before it (actors.kv.hashing), so ``seq_hash[i]`` present for a worker means that worker
cached exactly this prefix up to block ``i``; walking a request's sequence hashes in order and
stopping at the first miss is the radix-tree descent, with O(1) dict lookups per level, no node
objects and no parent pointers to maintain on removal. (A radix tree would also let us answer
"longest prefix" when an evicted middle block breaks the chain; so does the walk, which counts
consecutive leading blocks per worker, as Dynamo does.)

Owner sets are interned frozensets: most blocks share one of a few owner combinations, so each
block costs one dict entry plus one int in its worker's reverse set, even at millions of blocks.

Event ids are consecutive per (instance, dp_rank). A jump (or a first event with id > 0 from a
worker never seen) is a gap: the index returns a :class:`Gap`, buffers that worker's later events
and keeps serving matches from what it has; the transport answers the gap with a ``range`` query
(``apply_range``) or, when the publisher's ring no longer covers it, a ``dump`` (``load_dump``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from actors.kv.contract import KvRangeReply, KvSnapshot, RouterKvEvent
from actors.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

Worker = tuple[str, int]  # (instance, dp_rank)


@dataclass(frozen=True, slots=True)
class Gap:
    """Events ``start_event_id..end_event_id`` (inclusive; None = unknown) of ``worker`` are missing.

    ``dump`` is True when a range query cannot help (first contact, overflowing buffer, or the
    publisher said its ring no longer reaches back).
    """

    worker: Worker
    start_event_id: int
    end_event_id: int | None
    dump: bool = False


class _WorkerState:
    __slots__ = ("last_id", "gap", "pending", "block_size", "blocks", "epoch")

    def __init__(self) -> None:
        self.last_id = -1
        self.gap: Gap | None = None
        self.pending: list[RouterKvEvent] = []
        self.block_size: int | None = None
        self.blocks: set[int] = set()
        self.epoch: int | None = None


class KvIndex:
    """Exact index from KV events. Not thread-safe: use it from one event loop."""

    def __init__(self, block_size: int | None = None, *, metrics: RouterMetrics | None = None,
                 max_pending: int = 10_000) -> None:
        self.block_size = block_size
        self.metrics = metrics or RouterMetrics()
        self.max_pending = max_pending
        self._owners: dict[int, frozenset[Worker]] = {}
        self._workers: dict[Worker, _WorkerState] = {}
        self._add_cache: dict[tuple[frozenset[Worker], Worker], frozenset[Worker]] = {}
        self._del_cache: dict[tuple[frozenset[Worker], Worker], frozenset[Worker]] = {}
        self._single: dict[Worker, frozenset[Worker]] = {}
        self._warned_block_size: set[Worker] = set()
        # label children resolved once: .labels() costs more than the rest of a small event
        self._applied = {k: self.metrics.events_applied.labels(k) for k in ("stored", "removed", "cleared")}
        self.events_applied = 0
        self.duplicates = 0
        self.gaps = 0

    # ---- owner-set interning -----------------------------------------------------------------
    def _with(self, cur: frozenset[Worker] | None, w: Worker) -> frozenset[Worker]:
        if cur is None:
            s = self._single.get(w)
            if s is None:
                s = self._single[w] = frozenset((w,))
            return s
        key = (cur, w)
        s = self._add_cache.get(key)
        if s is None:
            s = self._add_cache[key] = cur | self._with(None, w)
        return s

    def _without(self, cur: frozenset[Worker], w: Worker) -> frozenset[Worker]:
        key = (cur, w)
        s = self._del_cache.get(key)
        if s is None:
            s = self._del_cache[key] = cur - self._with(None, w)
        return s

    def _state(self, w: Worker) -> _WorkerState:
        st = self._workers.get(w)
        if st is None:
            st = self._workers[w] = _WorkerState()
        return st

    # ---- applying events ---------------------------------------------------------------------
    def apply(self, event: RouterKvEvent) -> Gap | None:
        """Apply one event in id order; returns a :class:`Gap` when recovery must be requested."""
        w = (event.instance, event.dp_rank)
        st = self._workers.get(w)
        if st is None:
            st = self._state(w)
            st.epoch = event.epoch
            if event.event_id != 0:  # joined late: only a dump gives the full state
                return self._open_gap(st, w, 0, event, dump=True)
        elif event.epoch != st.epoch:
            # The publisher restarted and numbers from 0 again; its new state starts empty.
            log.warning("KV events of %s/%d: publisher restarted (new epoch); resetting its blocks",
                        w[0], w[1])
            self._drop_blocks(st, w)
            st.last_id, st.gap, st.pending, st.epoch = -1, None, [], event.epoch
            if event.event_id != 0:
                return self._open_gap(st, w, 0, event, dump=True)
        if st.gap is not None:
            self._buffer(st, w, event)
            return None
        if event.event_id <= st.last_id:
            self.duplicates += 1
            return None
        if event.event_id != st.last_id + 1:
            return self._open_gap(st, w, st.last_id + 1, event, dump=False)
        self._apply_one(st, w, event)
        return None

    def _open_gap(self, st: _WorkerState, w: Worker, start: int, event: RouterKvEvent,
                  dump: bool) -> Gap:
        self.gaps += 1
        self.metrics.event_gaps.inc()
        st.gap = Gap(w, start, event.event_id - 1, dump)
        st.pending = [event]
        log.warning("KV events of %s/%d: expected id %d, got %d; requesting %s", w[0], w[1], start,
                    event.event_id, "a dump" if dump else "a range")
        return st.gap

    def _buffer(self, st: _WorkerState, w: Worker, event: RouterKvEvent) -> None:
        if len(st.pending) >= self.max_pending:
            log.warning("KV events of %s/%d: %d events buffered during recovery; a dump is needed",
                        w[0], w[1], len(st.pending))
            st.pending.clear()
            st.gap = Gap(w, st.gap.start_event_id if st.gap else 0, None, True)
        st.pending.append(event)

    def _apply_one(self, st: _WorkerState, w: Worker, ev: RouterKvEvent) -> None:
        st.last_id = ev.event_id
        self.events_applied += 1
        self._applied[ev.kind].inc()
        if st.block_size != ev.block_size:
            st.block_size = ev.block_size
            self._check_block_size(w, ev.block_size)
        owners = self._owners
        if ev.kind == "stored":
            blocks = st.blocks
            for b in ev.stored:
                h = b.seq_hash
                if h in blocks:
                    continue
                blocks.add(h)
                owners[h] = self._with(owners.get(h), w)
        elif ev.kind == "removed":
            self._remove_hashes(st, w, ev.removed)
        else:  # cleared
            self._drop_blocks(st, w)
        self.metrics.index_blocks.set(len(owners))

    def _remove_hashes(self, st: _WorkerState, w: Worker, hashes: Iterable[int]) -> None:
        owners = self._owners
        blocks = st.blocks
        for h in hashes:
            if h not in blocks:
                continue
            blocks.discard(h)
            cur = owners[h]
            if len(cur) == 1:
                del owners[h]
            else:
                owners[h] = self._without(cur, w)

    def _drop_blocks(self, st: _WorkerState, w: Worker) -> int:
        n = len(st.blocks)
        self._remove_hashes(st, w, list(st.blocks))
        st.blocks = set()
        return n

    def _check_block_size(self, w: Worker, bs: int) -> None:
        if self.block_size is None or bs == self.block_size:
            return
        self.metrics.block_size_mismatch.labels(w[0], "events").inc()
        if w not in self._warned_block_size:
            self._warned_block_size.add(w)
            log.warning("KV block size MISMATCH: worker %s/%d publishes block size %d but this router "
                        "uses %d; it will be routed as if it had no cached prefix", w[0], w[1], bs,
                        self.block_size)

    def _drain(self, st: _WorkerState, w: Worker) -> Gap | None:
        pending = sorted(st.pending, key=lambda e: e.event_id)
        st.pending = []
        st.gap = None
        for i, ev in enumerate(pending):
            if ev.event_id <= st.last_id:
                continue
            if ev.event_id != st.last_id + 1:
                gap = self._open_gap(st, w, st.last_id + 1, ev, dump=False)
                st.pending.extend(pending[i + 1:])
                return gap
            self._apply_one(st, w, ev)
        return None

    # ---- recovery ----------------------------------------------------------------------------
    def apply_range(self, reply: KvRangeReply) -> Gap | None:
        """Apply a ``range`` reply for a worker in recovery; returns a further gap if any."""
        w = (reply.instance, reply.dp_rank)
        st = self._state(w)
        if not reply.complete:
            st.gap = Gap(w, st.last_id + 1, None, True)
            return st.gap
        for ev in sorted(reply.events, key=lambda e: e.event_id):
            if ev.event_id == st.last_id + 1 and (st.epoch is None or ev.epoch == st.epoch):
                self._apply_one(st, w, ev)
        return self._drain(st, w)

    def load_dump(self, instance: str, snapshot: KvSnapshot) -> Gap | None:
        """Replace a worker's blocks with a ``dump`` snapshot, then apply buffered later events."""
        w = (instance, snapshot.dp_rank)
        st = self._state(w)
        self._drop_blocks(st, w)
        st.block_size = snapshot.block_size
        self._check_block_size(w, snapshot.block_size)
        owners = self._owners
        for b in snapshot.blocks:
            h = b.seq_hash
            if h not in st.blocks:
                st.blocks.add(h)
                owners[h] = self._with(owners.get(h), w)
        st.last_id = snapshot.last_event_id
        if st.epoch != snapshot.epoch:  # buffered events of another incarnation are meaningless
            st.pending = [e for e in st.pending if e.epoch == snapshot.epoch]
            st.epoch = snapshot.epoch
        self.metrics.index_blocks.set(len(owners))
        return self._drain(st, w)

    def remove_worker(self, instance: str, dp_rank: int | None = None) -> int:
        """Forget a worker (all its DP ranks by default), e.g. when its registry entry expired."""
        removed = 0
        for w in [w for w in self._workers if w[0] == instance and (dp_rank is None or w[1] == dp_rank)]:
            removed += self._drop_blocks(self._workers[w], w)
            del self._workers[w]
            self._warned_block_size.discard(w)
        self.metrics.index_blocks.set(len(self._owners))
        # Interning caches may reference the dead worker; they are small, so just reset them.
        self._add_cache.clear()
        self._del_cache.clear()
        self._single = {k: v for k, v in self._single.items() if k[0] != instance}
        return removed

    # ---- queries -----------------------------------------------------------------------------
    def find_matches(self, seq_hashes: Sequence[int]) -> dict[Worker, int]:
        """Per worker, how many leading blocks of the request it holds (workers with 0 omitted)."""
        owners = self._owners
        result: dict[Worker, int] = {}
        active: frozenset[Worker] | None = None
        n = 0
        for h in seq_hashes:
            cur = owners.get(h)
            if cur is None:
                break
            if active is None:
                active = cur
            elif cur is not active:
                still = active & cur
                if len(still) != len(active):  # some workers' prefixes end here
                    for w in active - still:
                        result[w] = n
                    if not still:
                        active = None
                        break
                    active = cur if len(still) == len(cur) else still  # keep the interned object
            n += 1
        if active:
            for w in active:
                result[w] = n
        return result

    def holds(self, seq_hash: int, worker: Worker) -> bool:
        owners = self._owners.get(seq_hash)
        return owners is not None and worker in owners

    def workers(self) -> list[Worker]:
        return list(self._workers)

    def worker_blocks(self, worker: Worker) -> int:
        st = self._workers.get(worker)
        return len(st.blocks) if st else 0

    def worker_hashes(self, worker: Worker) -> list[int]:
        """The sequence hashes a worker holds (for ``index.dump``)."""
        st = self._workers.get(worker)
        return list(st.blocks) if st else []

    def worker_block_size(self, worker: Worker) -> int | None:
        st = self._workers.get(worker)
        return st.block_size if st else None

    def last_event_id(self, worker: Worker) -> int:
        st = self._workers.get(worker)
        return st.last_id if st else -1

    def pending_gaps(self) -> list[Gap]:
        """Workers still waiting for recovery (the transport retries these)."""
        return [st.gap for st in self._workers.values() if st.gap is not None]

    def __len__(self) -> int:
        return len(self._owners)

    def stats(self) -> dict:
        return {
            "blocks": len(self._owners),
            "workers": {f"{w[0]}/{w[1]}": {"blocks": len(st.blocks), "last_event_id": st.last_id,
                                           "block_size": st.block_size,
                                           "recovering": st.gap is not None}
                        for w, st in self._workers.items()},
            "events_applied": self.events_applied,
            "duplicates": self.duplicates,
            "gaps": self.gaps,
            "block_size": self.block_size,
        }
