"""A vLLM stat logger that keeps the latest scheduler view per DP rank as ``EngineStats``.

vLLM builds stat loggers itself from factories ``(vllm_config, engine_index) -> StatLoggerBase``,
so the logger cannot be handed an engine object; ``StatsSink.logger_factory()`` returns a factory
closed over the sink, which the engine owns. One sink per engine: vLLM's Prometheus logger is
process-global and each new AsyncLLM unregisters the previous one's series.

Step samples: with ``enable_logging_iteration_details`` (``vllm_args`` turns it on) every
``SchedulerStats`` of an iteration that computed something carries ``iteration_details``
(context tokens, generation requests, the iteration's elapsed time, measured in EngineCore around
the model's forward pass and sampling). The sink keeps each as a ``StepSample``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from actors.engines.protocol import EngineStats, StepSample

# Step samples kept until the engine actor takes them; the oldest go first when nobody does.
MAX_STEP_SAMPLES = 4096


class StatsSink:
    """Latest EngineStats per DP rank, plus cumulative counters vLLM only reports as deltas."""

    def __init__(self) -> None:
        self._stats: dict[int, EngineStats] = {}
        self.total_kv_blocks = 0  # per rank; set once the engine knows its cache size
        self.block_size = 0  # tokens per KV block; set with total_kv_blocks
        self.steps: deque[StepSample] = deque(maxlen=MAX_STEP_SAMPLES)
        self._usage_after: dict[int, float] = {}  # KV usage after each rank's latest step
        self.external_queries: dict[int, int] = {}  # KV-connector (e.g. NIXL) lookups, in tokens
        self.external_hits: dict[int, int] = {}
        self.kv_transfer_stats: dict[int, dict[str, Any]] = {}  # last non-empty connector stats
        self.finished: dict[int, int] = {}  # finished requests per rank

    def ensure_ranks(self, dp_size: int) -> None:
        for rank in range(dp_size):
            self._stats.setdefault(rank, EngineStats(dp_rank=rank, total_kv_blocks=self.total_kv_blocks))

    def latest(self) -> list[EngineStats]:
        return [self._stats[r] for r in sorted(self._stats)]

    def take_steps(self) -> list[StepSample]:
        out = list(self.steps)
        self.steps.clear()
        return out

    def _record_step(self, rank: int, scheduler_stats: Any) -> None:
        usage = float(scheduler_stats.kv_cache_usage)
        before = self._usage_after.get(rank, 0.0)
        self._usage_after[rank] = usage
        d = getattr(scheduler_stats, "iteration_details", None)
        if d is None or d.is_dummy:  # a DP rank's idle forward pass says nothing about load
            return
        # vLLM reads the usage after the step, once the requests that finished in it have
        # released their blocks (a lone request's last step would read 0); the larger of the
        # usage after the previous step and after this one is what the step's batch held, unless
        # requests both joined and left in it
        held = max(before, usage)
        kv_tokens = round(held * self.total_kv_blocks) * self.block_size
        self.steps.append(StepSample(prefill_tokens=d.num_ctx_tokens,
                                     decode_requests=d.num_generation_requests, kv_tokens=kv_tokens,
                                     elapsed_ms=float(d.elapsed_ms), dp_rank=rank))

    def record(self, rank: int, scheduler_stats: Any, iteration_stats: Any) -> None:
        if iteration_stats is not None and iteration_stats.finished_requests:
            self.finished[rank] = self.finished.get(rank, 0) + len(iteration_stats.finished_requests)
        if scheduler_stats is None:
            return
        self._record_step(rank, scheduler_stats)
        prev = self._stats.get(rank) or EngineStats(dp_rank=rank)
        pcs = scheduler_stats.prefix_cache_stats
        queries, hits = prev.prefix_queries, prev.prefix_hits
        if pcs is not None:
            queries += pcs.queries
            hits += pcs.hits
        ext = scheduler_stats.connector_prefix_cache_stats
        if ext is not None:
            self.external_queries[rank] = self.external_queries.get(rank, 0) + ext.queries
            self.external_hits[rank] = self.external_hits.get(rank, 0) + ext.hits
        if scheduler_stats.kv_connector_stats:
            self.kv_transfer_stats[rank] = dict(scheduler_stats.kv_connector_stats)
        total = self.total_kv_blocks
        usage = float(scheduler_stats.kv_cache_usage)
        self._stats[rank] = EngineStats(
            dp_rank=rank,
            num_running=scheduler_stats.num_running_reqs,
            num_waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
            kv_usage=usage,
            active_kv_blocks=round(usage * total),
            total_kv_blocks=total,
            prefix_queries=queries,
            prefix_hits=hits,
            step=prev.step + 1,
            ts=time.time(),
        )

    def logger_factory(self) -> Any:
        """A per-engine StatLoggerFactory for ``AsyncLLM(stat_loggers=[...])`` feeding this sink."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _SinkLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                sink.record(engine_idx, scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _SinkLogger
