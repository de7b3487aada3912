"""Worker selection: the lowest predicted latency, or (an override) a weighted sum of blocks.

**Latency (the default).** Each candidate is priced by ``actors.router.latency``: the TTFT this
request would see there plus the delay it would add to the streams the worker already runs, in
milliseconds of that worker's measured step times (learned from its load reports). The lowest
wins, give or take what the model cannot tell apart: a worker is sampled with softmax weights
exp(−(cost − best)/T), as Dynamo samples its router's logits, where T is the spread of the model's own
TTFT error (actual − predicted, learned from every first token; see ``PredictionError``) and at least
a near-tie ``tie`` = max(``TIE_MS``, ``TIE_FRACTION`` × best). Among near-ties the workers with the
fewest cached blocks are preferred (new prefixes spread onto emptier caches).

**Weights (when ``prefill_load_scale`` is set).** cost = prefill_load_scale × new_prefill_blocks +
active_decode_blocks, where ``new_prefill_blocks = request_blocks − overlap_blocks + active_prefill_tokens / block_size``
(fractional, as in Dynamo): what the worker would still have to prefill, including the queue it
already has. Lowest cost wins. Ties go to the worker with the *smaller index* (fewer cached blocks
in the KV index, Dynamo's tie-break: it spreads new prefixes onto emptier caches), then random.
With ``temperature > 0`` (either mode) a worker is sampled with probability ∝ exp(−normalised_cost / T), where
costs are min-max normalised to [0, 1] so T means the same at any load.

Busy workers (reported KV usage ≥ ``busy_threshold``) are excluded; if every candidate is busy the
request is refused with :class:`Overloaded`. A worker whose block size differs from the router's
is costed with zero overlap (its hashes cannot match ours), with a warning once per worker and a
counter increment per decision, so misconfiguration never looks like a silent 0 % hit rate.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from actors.router.latency import LatencyModel, WorkerState
from actors.router.load import LoadTracker
from actors.router.metrics import RouterMetrics
from bus.errors import Overloaded

log = logging.getLogger(__name__)

Worker = tuple[str, int]
_EPS = 1e-9
# latency mode: costs this close to the best are a near-tie (one cached 16-token block is worth
# ~0.25 ms of prefill at the default rates, over ten times TIE_MS: a hit is never a tie with a miss)
TIE_FRACTION = 0.001
TIE_MS = 0.02


class IndexView(Protocol):
    def worker_blocks(self, worker: Worker) -> int: ...

    def worker_block_size(self, worker: Worker) -> int | None: ...


@dataclass(slots=True)
class RouterConfig:
    block_size: int
    prefill_load_scale: float | None = None  # None: price by predicted latency; a number: weights
    temperature: float = 0.0
    busy_threshold: float | None = None  # KV usage fraction (0-1); None = never exclude


@dataclass(slots=True)
class WorkerCost:
    instance: str
    dp_rank: int
    overlap_blocks: int
    new_prefill_blocks: float
    decode_blocks: int
    cost: float
    block_size_mismatch: bool = False
    ttft_ms: float | None = None  # latency mode: the predicted TTFT there
    stream_cost_ms: float | None = None  # latency mode: the delay added to its running streams
    line: str | None = None  # latency mode: "worker", "pool" or "default" (which step line priced it)


@dataclass(slots=True)
class RoutingDecision:
    instance: str
    dp_rank: int
    overlap_blocks: int
    cost: float
    request_blocks: int
    costs: list[WorkerCost] = field(default_factory=list)
    excluded_busy: list[str] = field(default_factory=list)
    mode: str = "kv"
    cost_model: str = "latency"  # or "weights"

    @property
    def worker(self) -> Worker:
        return (self.instance, self.dp_rank)

    def to_dict(self) -> dict:
        return asdict(self)


class CostSelector:
    def __init__(self, config: RouterConfig, *, metrics: RouterMetrics | None = None,
                 rng: random.Random | None = None, latency: LatencyModel | None = None) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.rng = rng or random.Random()
        self.latency = latency or LatencyModel()
        self._warned: set[Worker] = set()

    def _mismatch(self, w: Worker, index: IndexView, block_sizes: Mapping[Worker, int | None]) -> bool:
        bs = block_sizes.get(w) or index.worker_block_size(w)
        if bs is None or bs == self.config.block_size:
            return False
        self.metrics.block_size_mismatch.labels(w[0], "routing").inc()
        if w not in self._warned:
            self._warned.add(w)
            log.warning("KV block size MISMATCH: worker %s/%d uses block size %d, router uses %d; "
                        "routing it as if nothing were cached (fix the topology's block size)",
                        w[0], w[1], bs, self.config.block_size)
        return True

    def select(self, workers: Sequence[Worker], request_tokens: int, overlaps: Mapping[Worker, int],
               load: LoadTracker, index: IndexView, *,
               block_sizes: Mapping[Worker, int | None] | None = None) -> RoutingDecision:
        """Pick a worker for a request of ``request_tokens`` prompt tokens."""
        if not workers:
            raise Overloaded("no worker available")
        cfg = self.config
        bs = cfg.block_size
        block_sizes = block_sizes or {}
        req_blocks = request_tokens / bs
        busy: list[str] = []
        costs: list[WorkerCost] = []
        scale = cfg.prefill_load_scale
        eligible: list[tuple[Worker, int, bool]] = []
        for w in workers:
            if cfg.busy_threshold is not None:
                usage = load.kv_usage(w)
                if usage is not None and usage >= cfg.busy_threshold:
                    busy.append(f"{w[0]}/{w[1]}")
                    continue
            mismatch = self._mismatch(w, index, block_sizes)
            eligible.append((w, 0 if mismatch else overlaps.get(w, 0), mismatch))
        # latency mode: the prefill a worker would compute beyond what the best-cached one would is
        # avoidable work (see actors.router.latency)
        best_overlap = max((o for _, o, _ in eligible), default=0)
        for w, overlap, mismatch in eligible:
            queued = load.prefill_tokens(w)
            prefill = req_blocks - overlap + queued / bs
            decode = load.decode_blocks(w)
            if scale is not None:
                costs.append(WorkerCost(w[0], w[1], overlap, prefill, decode, scale * prefill + decode, mismatch))
                continue
            state = WorkerState(queued_prefill=queued, kv_tokens=decode * bs, running=load.running(w),
                                capacity_tokens=self.latency.capacity(w))
            uncached = max(0, request_tokens - overlap * bs)
            wasted = min(uncached, (best_overlap - overlap) * bs)
            est = self.latency.estimate(w, state, request_tokens, uncached, wasted)
            costs.append(WorkerCost(w[0], w[1], overlap, prefill, decode, est.cost, mismatch,
                                    est.ttft_ms, est.stream_cost_ms, est.source))
        if not costs:
            raise Overloaded(f"all {len(workers)} workers are busy (KV usage >= {cfg.busy_threshold})")
        if cfg.temperature > 0:
            chosen = self._sample(costs)
        elif scale is None:
            chosen = self._near_tie(costs, index)
        else:
            chosen = self._argmin(costs, index)
        return RoutingDecision(chosen.instance, chosen.dp_rank, chosen.overlap_blocks, chosen.cost,
                               request_tokens // bs, costs, busy,
                               cost_model="weights" if scale is not None else "latency")

    def _near_tie(self, costs: list[WorkerCost], index: IndexView) -> WorkerCost:
        """A worker sampled with softmax weights exp(−(cost − best)/T). Workers whose caches hold as
        much of the prompt as the cheapest one's are sampled with T = the latency model's prediction
        error (its spread: ``LatencyModel.error``): what sets them apart is load, which the model
        predicts only that well. The others take part only within a near-tie (T = ``tie``): what
        a cache hit saves is known exactly. Of workers within a near-tie of the cheapest, only those
        with the fewest cached blocks take part (new prefixes spread onto emptier caches)."""
        if len(costs) == 1:
            return costs[0]
        cheapest = min(costs, key=lambda c: c.cost)
        best = cheapest.cost
        tie = max(TIE_MS, TIE_FRACTION * best)
        spread = max(tie, self.latency.error.spread_ms)
        temp = {id(c): spread if c.overlap_blocks == cheapest.overlap_blocks else tie for c in costs}
        near = [c for c in costs if c.cost - best <= 4 * temp[id(c)]]  # farther ones would weigh < 2 %
        tied = [c for c in near if c.cost - best <= 4 * tie]
        if len(tied) > 1:
            blocks = {id(c): index.worker_blocks((c.instance, c.dp_rank)) for c in tied}
            fewest = min(blocks.values())
            near = [c for c in near if blocks.get(id(c), fewest) == fewest]
        if len(near) == 1:
            return near[0]
        weights = [math.exp(-(c.cost - best) / temp[id(c)]) for c in near]
        return self.rng.choices(near, weights=weights, k=1)[0]

    def _argmin(self, costs: list[WorkerCost], index: IndexView) -> WorkerCost:
        best = min(c.cost for c in costs)
        tied = [c for c in costs if c.cost <= best + _EPS]
        if len(tied) > 1:
            smallest = min(index.worker_blocks((c.instance, c.dp_rank)) for c in tied)
            tied = [c for c in tied if index.worker_blocks((c.instance, c.dp_rank)) == smallest]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def _sample(self, costs: list[WorkerCost]) -> WorkerCost:
        lo = min(c.cost for c in costs)
        hi = max(c.cost for c in costs)
        span = hi - lo
        if span <= _EPS:
            return self.rng.choice(costs)
        t = self.config.temperature
        weights = [math.exp(-((c.cost - lo) / span) / t) for c in costs]
        return self.rng.choices(costs, weights=weights, k=1)[0]
