"""Replay a request sequence against simulated per-worker prefix caches (the shared-prefix bench's oracle).

Each worker is an LRU of router sequence hashes (``actors.kv.hashing.sequence_hashes``) with the
engine's capacity in blocks. The eviction order mirrors the mocker's/vLLM's free queue: when a request
finishes its blocks are freed tail-first, so its unique tail (question, output) is evicted before its
shared prefix. Requests are replayed one at a time (no in-flight overlap), so the capacity taken by
running requests and the "second request of a group arrives before the first has prefilled" effect are
ignored: that makes the oracle an upper bound for a concurrent run, not an exact prediction.

Hits count full blocks only, as the engines report ``cached_tokens``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence


class LruBlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def hit_blocks(self, seq_hashes: Sequence[int]) -> int:
        n = 0
        for h in seq_hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def run(self, seq_hashes: Sequence[int], unique_tail_blocks: int, fresh: Callable[[], int]) -> None:
        """Admit a request's prompt blocks plus ``unique_tail_blocks`` never-shared output blocks, then
        free them tail-first (the last block freed is the most recently used)."""
        tail = [fresh() for _ in range(unique_tail_blocks)]
        for h in reversed(list(seq_hashes) + tail):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def replay(requests: Sequence[Sequence[int]], n_workers: int, capacity_blocks: int,
           tail_blocks: int, choose: Callable[[int, list[int]], int]) -> dict[str, object]:
    """Replay ``requests`` (sequence hashes each). ``choose(i, hits_per_worker)``
    returns the worker for request i. Returns hit blocks per request and the chosen workers."""
    caches = [LruBlockCache(capacity_blocks) for _ in range(n_workers)]
    counter = itertools.count(1 << 62)  # ids no real sequence hash collides with in practice
    fresh = counter.__next__
    hits: list[int] = []
    chosen: list[int] = []
    for i, hs in enumerate(requests):
        per = [c.hit_blocks(hs) for c in caches]
        w = choose(i, per)
        hits.append(per[w])
        chosen.append(w)
        caches[w].run(hs, tail_blocks, fresh)
    return {"hit_blocks": hits, "workers": chosen}


def oracle_chooser(n_workers: int, window: int) -> Callable[[int, list[int]], int]:
    """Longest cached prefix; ties go to the worker with the fewest of the last ``window`` requests
    (a stand-in for the requests in flight at the bench's concurrency), then the lowest index."""
    recent: deque[int] = deque(maxlen=window)

    def choose(i: int, hits: list[int]) -> int:
        inflight = [0] * n_workers
        for w in recent:
            inflight[w] += 1
        best = max(range(n_workers), key=lambda w: (hits[w], -inflight[w], -w))
        recent.append(best)
        return best

    return choose


def fixed_chooser(assignment: Sequence[int]) -> Callable[[int, list[int]], int]:
    """Replay the worker choices a real run made (to check the simulation against measured hits)."""
    return lambda i, _hits: assignment[i]
