"""A vLLM-v1-style scheduler for one DP rank: waiting + running queues, a token budget per step.

One ``step()`` (vLLM's unified scheduling, FCFS):
1. Running requests first, in order: each gets ``num_tokens - num_computed`` new tokens (1 for a
   decode, a chunk for a partial prefill), capped by the remaining budget. If the pool cannot give
   the blocks, the *last* running request is preempted (recompute style: blocks freed, progress
   reset to 0, back to the head of the waiting queue) until it fits or the request itself is the
   victim.
2. Then, if nothing was preempted, waiting requests while budget and ``max_num_seqs`` allow:
   prefix-cache lookup (full blocks, at most ``num_tokens - 1`` tokens, like vLLM), plus any
   remote (disaggregated) KV, then the rest of the prompt as one chunk (or the whole prompt when
   chunked prefill is off).
3. Every request whose computed tokens now reach its length samples one token (EOS / stop ids /
   max_tokens / max_model_len end it).

Blocks are cached (``BlockStored``) when they are *scheduled* full, before the step computes them,
as vLLM v1's ``KVCacheManager.allocate_slots`` does (it caches up to the computed + new tokens): a
request admitted later in the same step hits the prefix an earlier one is computing in it, the KV
being written in the same forward pass before it is read. Caching only after the step would make
two requests with the same prefix that arrive together both compute it, which vLLM does not.

The scheduler is synchronous and knows nothing about time or asyncio; the engine loop drives it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from actors.engines.mm_keys import MmKey, MmSpan, mm_block_keys
from actors.engines.mocker.kv_pool import BlockPool
from actors.engines.mocker.tokens import block_hash
from actors.engines.protocol import FinishReason


@dataclass(eq=False)
class MockRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    min_tokens: int = 0
    eos_token_id: int | None = None  # None when ignore_eos
    stop_token_ids: frozenset[int] = frozenset()
    lora_name: str | None = None
    lora_id: int | None = None
    request_seed: int | None = None
    remote_prefill_tokens: int = 0  # prompt tokens whose KV arrives from a prefill engine
    token_seed: int = 0  # tokens.hash_seed(engine seed, LoRA, request seed)
    script: list[int] | None = None  # a scripted reply's tokens still to come (then EOS)
    mm: tuple[MmSpan, ...] = ()  # the prompt's images: their blocks are keyed by them, as in vLLM
    sink: Any = None  # engine-side delivery object (queue)
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0  # blocks already registered in the pool
    cached_tokens: int | None = None  # prefix-cache hits at first scheduling
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    released_blocks: list[int] = field(default_factory=list)  # blocks held when it finished
    mm_keys: list[tuple[MmKey, ...]] = field(default_factory=list)  # per prompt block (update_hashes)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extra_keys(self, i: int) -> tuple[Any, ...] | None:
        """Block ``i``'s extra keys as vLLM makes them (and its events carry them): the LoRA name,
        then ``(image id, offset in the block)`` per image touching the block; None without any."""
        mm = self.mm_keys[i] if i < len(self.mm_keys) else ()
        if not mm:
            return (self.lora_name,) if self.lora_name else None
        return ((self.lora_name, *mm) if self.lora_name else mm)

    def update_hashes(self, block_size: int) -> None:
        """Extend ``block_hashes`` to every full block of the known token sequence."""
        if self.mm and not self.mm_keys:
            end = max(sp.offset + sp.length for sp in self.mm)
            self.mm_keys = mm_block_keys(self.mm, block_size, -(-end // block_size))
        toks = None
        while (len(self.block_hashes) + 1) * block_size <= self.num_tokens:
            toks = toks or self.all_tokens
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(
                block_hash(parent, toks[i * block_size:(i + 1) * block_size], self.extra_keys(i)))


@dataclass
class StepResult:
    step: int
    prefill_tokens: int = 0
    num_decode: int = 0
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> new tokens
    sampled: list[tuple[MockRequest, int]] = field(default_factory=list)
    finished: list[MockRequest] = field(default_factory=list)
    preempted: list[MockRequest] = field(default_factory=list)


@dataclass(eq=False)
class Scheduler:
    pool: BlockPool
    _: KW_ONLY
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    max_loras: int
    sample: Callable[[MockRequest], int]
    waiting: deque[MockRequest] = field(default_factory=deque, init=False)
    running: list[MockRequest] = field(default_factory=list, init=False)
    requests: dict[str, MockRequest] = field(default_factory=dict, init=False)
    step_count: int = field(default=0, init=False)
    prefix_queries: int = field(default=0, init=False)
    prefix_hits: int = field(default=0, init=False)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # --- queue management --------------------------------------------------------------------
    def add(self, req: MockRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.update_hashes(self.block_size)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, req: MockRequest, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a request (also used for abort): free its blocks, drop it from the queues."""
        if req.finished:
            return
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.released_blocks = list(req.blocks)
        self._free(req)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.requests.pop(req.request_id, None)

    def _free(self, req: MockRequest) -> None:
        self.pool.free_blocks(list(reversed(req.blocks)))  # tail first: evicted first
        req.blocks = []
        req.num_cached_blocks = 0

    def _preempt(self, req: MockRequest) -> None:
        self._free(req)
        req.num_computed = 0
        req.remote_prefill_tokens = 0  # the hand-off KV is gone: recompute everything
        self.waiting.appendleft(req)

    # --- allocation --------------------------------------------------------------------------
    def _try_allocate(self, req: MockRequest, num_new: int, hit_blocks: list[int]) -> bool:
        total = req.num_computed + num_new
        need = -(-total // self.block_size) - len(req.blocks) - len(hit_blocks)
        need = max(0, need)
        if need + self.pool.num_evictable_among(hit_blocks) > self.pool.num_free:
            return False
        self.pool.touch(hit_blocks)
        req.blocks.extend(hit_blocks)
        new = self.pool.allocate(need)
        assert new is not None
        req.blocks.extend(new)
        return True

    def _cache_full_blocks(self, req: MockRequest, computed_after: int) -> None:
        full = min(computed_after, req.num_tokens) // self.block_size
        start = req.num_cached_blocks
        if full <= start:
            return
        if self.pool.enable_prefix_caching:
            toks = req.all_tokens[start * self.block_size:full * self.block_size]
            parent = req.block_hashes[start - 1] if start > 0 else None
            self.pool.cache_blocks(req.blocks[start:full], req.block_hashes[start:full], parent,
                                   toks, req.lora_id, req.lora_name,
                                   extra_keys=[req.extra_keys(i) for i in range(start, full)])
        req.num_cached_blocks = full

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        self.step_count += 1
        res = StepResult(step=self.step_count)
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[MockRequest, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed, budget,
                          self.max_model_len - req.num_computed)
            ok = False
            while True:
                if self._try_allocate(req, num_new, []):
                    ok = True
                    break
                victim = self.running.pop()
                self._preempt(victim)
                res.preempted.append(victim)
                if victim is req:
                    break
            if not ok:
                break
            self._cache_full_blocks(req, req.num_computed + num_new)
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        if not res.preempted:
            budget = self._admit_waiting(budget, scheduled)

        for req, num_new in scheduled:
            in_prefill = req.num_computed < len(req.prompt)
            if in_prefill:
                res.prefill_tokens += num_new
            else:
                res.num_decode += 1
            res.scheduled[req.request_id] = num_new
            req.num_computed += num_new
            if req.num_computed >= req.num_tokens:
                tok = self.sample(req)
                req.output.append(tok)
                req.update_hashes(self.block_size)
                res.sampled.append((req, tok))
                reason, stop_reason = self._check_stop(req, tok)
                if reason is not None:
                    self.finish(req, reason, stop_reason)
                    res.finished.append(req)
        return res

    def _admit_waiting(self, budget: int, scheduled: list[tuple[MockRequest, int]]) -> int:
        skipped: list[MockRequest] = []
        loras = {r.lora_name for r in self.running if r.lora_name}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.lora_name and req.lora_name not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())  # like vLLM: wait for a LoRA slot
                continue
            hits: list[int] = []
            first = req.cached_tokens is None
            if req.num_computed == 0:
                max_hit_blocks = (req.num_tokens - 1) // self.block_size
                hits = self.pool.lookup(req.block_hashes[:max_hit_blocks])
            local = len(hits) * self.block_size
            remote = max(0, req.remote_prefill_tokens - local) if req.num_computed == 0 else 0
            computed = req.num_computed + local + remote
            num_new = req.num_tokens - computed
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            base = req.num_computed
            req.num_computed = base + local
            if not self._try_allocate(req, remote + num_new, hits):
                req.num_computed = base
                break
            self.waiting.popleft()
            if first:
                req.cached_tokens = local + remote
                self.prefix_queries += req.num_tokens
                self.prefix_hits += local
            req.num_cached_blocks = len(hits)
            if remote:  # simulated hand-off: the KV is just there, no compute
                req.num_computed += remote
            # the handed-off and the scheduled blocks, before the next request's lookup
            self._cache_full_blocks(req, req.num_computed + num_new)
            self.running.append(req)
            if req.lora_name:
                loras.add(req.lora_name)
            scheduled.append((req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _check_stop(self, req: MockRequest, tok: int) -> tuple[FinishReason | None, int | None]:
        """vLLM's ``check_stop`` order: EOS, stop ids, then length (min_tokens is enforced by
        the sampler, which never draws EOS/stop ids before it)."""
        if req.eos_token_id is not None and tok == req.eos_token_id:
            return "stop", None
        if tok in req.stop_token_ids:
            return "stop", tok
        if req.num_tokens >= self.max_model_len or len(req.output) >= req.max_tokens:
            return "length", None
        return None, None
