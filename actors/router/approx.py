"""Approximate KV index, fed by the router's own decisions; two uses.

* For engines without KV events (``mode="approx"``) it *is* the index.
* In ``mode="kv"`` it is the **prediction overlay** over the event-fed KvIndex: a routed request's
  blocks count as cached on the chosen worker at once, before its KV events arrive (Dynamo books
  its decisions the same way). ``forget`` / ``forget_worker`` end predictions that events confirm
  or contradict.

After routing a request to a worker we *assume* the worker now caches the request's full blocks
for ``ttl`` seconds (re-routing the same prefix refreshes it). Same query interface as
:class:`actors.router.index.KvIndex` (``find_matches``, ``worker_blocks``, ``worker_block_size``)
so the cost function does not care which one it gets. Expiry is lazy on lookup plus an amortised
sweep of a FIFO (the TTL is constant, so insertion order is expiry order).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

Worker = tuple[str, int]


class ApproxIndex:
    def __init__(self, ttl: float = 120.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._owners: dict[int, dict[Worker, float]] = {}  # seq hash -> {worker: expiry}
        self._counts: dict[Worker, int] = {}
        self._fifo: deque[tuple[float, Worker, Sequence[int]]] = deque()

    def record(self, worker: Worker, seq_hashes: Sequence[int]) -> None:
        """The router sent a request with these sequence hashes to ``worker``."""
        now = self._clock()
        self.prune(now)
        exp = now + self.ttl
        owners = self._owners
        added = 0
        for h in seq_hashes:
            d = owners.get(h)
            if d is None:
                d = owners[h] = {}
            if worker not in d:
                added += 1
            d[worker] = exp
        if added:
            self._counts[worker] = self._counts.get(worker, 0) + added
        self._fifo.append((exp, worker, seq_hashes))

    def prune(self, now: float | None = None) -> int:
        """Drop assumed blocks whose TTL ran out; returns how many (hash, worker) pairs went."""
        now = self._clock() if now is None else now
        gone = 0
        fifo, owners = self._fifo, self._owners
        while fifo and fifo[0][0] <= now:
            _, w, hashes = fifo.popleft()
            for h in hashes:
                d = owners.get(h)
                if d is None:
                    continue
                exp = d.get(w)
                if exp is not None and exp <= now:  # not refreshed by a later record()
                    del d[w]
                    gone += 1
                    self._counts[w] -= 1
                    if not d:
                        del owners[h]
        return gone

    def find_matches(self, seq_hashes: Sequence[int]) -> dict[Worker, int]:
        now = self._clock()
        owners = self._owners
        result: dict[Worker, int] = {}
        active: set[Worker] | None = None
        for n, h in enumerate(seq_hashes):
            d = owners.get(h)
            live = {w for w, exp in d.items() if exp > now} if d else set()
            if active is None:
                active = live
            else:
                for w in active - live:
                    result[w] = n
                active &= live
            if not active:
                return result
        for w in active or ():
            result[w] = len(seq_hashes)
        return result

    def now(self) -> float:
        return self._clock()

    def holds(self, seq_hash: int, worker: Worker, now: float) -> bool:
        """Whether ``worker`` is assumed to hold ``seq_hash`` at ``now`` (unexpired)."""
        d = self._owners.get(seq_hash)
        if d is None:
            return False
        exp = d.get(worker)
        return exp is not None and exp > now

    def live_owners(self, seq_hash: int, now: float) -> list[Worker]:
        d = self._owners.get(seq_hash)
        return [w for w, exp in d.items() if exp > now] if d else []

    def forget(self, worker: Worker, seq_hashes: Iterable[int]) -> int:
        """End the assumption for these blocks of ``worker`` (events confirmed or removed them)."""
        owners = self._owners
        gone = 0
        for h in seq_hashes:
            d = owners.get(h)
            if d is None or worker not in d:
                continue
            del d[worker]
            gone += 1
            if not d:
                del owners[h]
        if gone:
            self._counts[worker] -= gone
        return gone

    def forget_worker(self, worker: Worker) -> int:
        """End every assumption about one (instance, dp_rank) (its cache was cleared)."""
        n = self._counts.pop(worker, 0)
        if n:
            for h in [h for h, d in self._owners.items() if worker in d]:
                d = self._owners[h]
                del d[worker]
                if not d:
                    del self._owners[h]
        return n

    def predicted(self) -> int:
        """(block, worker) pairs currently assumed, expired ones not yet swept included."""
        return sum(self._counts.values())

    def remove_worker(self, instance: str) -> None:
        if not any(w[0] == instance for w in self._counts):
            return  # registry removals of other actors are frequent; skip the full scan
        for h in list(self._owners):
            d = self._owners[h]
            for w in [w for w in d if w[0] == instance]:
                del d[w]
            if not d:
                del self._owners[h]
        for w in [w for w in self._counts if w[0] == instance]:
            del self._counts[w]

    def worker_blocks(self, worker: Worker) -> int:
        return self._counts.get(worker, 0)

    def worker_block_size(self, worker: Worker) -> int | None:
        return None  # hashes come from the router itself: always the router's block size

    def __len__(self) -> int:
        return len(self._owners)

    def stats(self) -> dict:
        self.prune()
        return {"blocks": len(self._owners), "ttl": self.ttl,
                "workers": {f"{w[0]}/{w[1]}": n for w, n in self._counts.items() if n}}
