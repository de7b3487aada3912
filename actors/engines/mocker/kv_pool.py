"""A KV block pool with prefix caching, modelled on vLLM v1's ``BlockPool``.

- Every block has a refcount; blocks with refcount 0 sit in a free queue (an LRU: freed blocks go
  to the tail, allocation pops from the head). Requests free their blocks tail-first, so a
  request's last blocks are evicted before its shared prefix, as in vLLM.
- A free block may still hold a cached hash: it stays reusable by a prefix hit until allocation
  evicts it, which emits ``BlockRemoved``. Caching a full block emits ``BlockStored``.
- Events accumulate in ``events`` until the engine loop publishes them with its step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from actors.engines.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    VllmKvEvent,
)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 emit_events: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.emit_events = emit_events and enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.events: list[VllmKvEvent] = []

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def lookup(self, hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_evictable_among(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    # --- mutations ---------------------------------------------------------------------------
    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on prefix-hit blocks (removing free ones from the free queue)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks from the LRU head, evicting cached hashes; None if not enough."""
        if n > len(self.free):
            return None
        out: list[int] = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        self.block_hash[b] = None
        if self.cached.get(h) == b:
            del self.cached[h]
            if self.emit_events:
                self.events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=0))

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference each; pass them in eviction order (callers reverse a request's list)."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def cache_blocks(self, block_ids: list[int], hashes: list[int], parent: int | None,
                     token_ids: list[int], lora_id: int | None, lora_name: str | None, *,
                     extra_keys: list[tuple[Any, ...] | None] | None = None) -> None:
        """Register newly full blocks under their hashes and emit one ``BlockStored`` for them.

        ``extra_keys``: per block, as vLLM publishes them (the request's ``extra_keys(i)``); by
        default the LoRA name alone. A hash already cached by another block is re-announced (vLLM
        does the same; consumers treat stores idempotently) but keeps pointing at the first block.
        """
        if not self.enable_prefix_caching or not block_ids:
            return
        for b, h in zip(block_ids, hashes, strict=True):
            if h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
        if self.emit_events:
            extra = extra_keys if extra_keys is not None else \
                [(lora_name,) if lora_name else None for _ in block_ids]
            self.events.append(BlockStored(
                block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(token_ids),
                block_size=self.block_size, lora_id=lora_id, medium=MEDIUM_GPU, lora_name=lora_name,
                extra_keys=extra, group_idx=0, kv_cache_spec_kind="full_attention"))

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget every cached hash (``AllBlocksCleared``). Like vLLM, refuses (False) while
        requests hold blocks unless ``force``."""
        if not force and self.num_used > 0:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.emit_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[VllmKvEvent]:
        ev, self.events = self.events, []
        return ev
