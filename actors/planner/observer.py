"""What the planner has seen since its last decision (logic only, no NATS).

Inputs arrive from the bus as they are published: every frontend's ``FrontendWindow`` and every
worker's ``LoadReport``. ``take_interval`` sums the windows that ended since the previous call into
one ``Observed`` (rates per second of the real elapsed time, means over finished requests, latency
from the merged histograms). Load reports keep the latest per (instance, rank), and their step
samples go to the pool's step regression (load mode).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from actors.engines.protocol import StepSample
from actors.planner.contract import (
    ITL_BOUNDS_MS,
    TTFT_BOUNDS_MS,
    FrontendWindow,
    Histogram,
    Observed,
)
from actors.worker.contract import LoadReport

# a load report older than this is a worker that stopped reporting (gone, or its bus is)
REPORT_STALE_S = 10.0
# step samples kept per pool between two decisions (the regression keeps its own window)
STEP_WINDOW = 8192


@dataclass
class Totals:
    """Sums over some windows."""

    requests: int = 0
    finished: int = 0
    failed: int = 0
    isl_tokens: int = 0
    osl_tokens: int = 0
    cached_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram.empty(TTFT_BOUNDS_MS))
    itl: Histogram = field(default_factory=lambda: Histogram.empty(ITL_BOUNDS_MS))

    def add(self, w: FrontendWindow) -> None:
        self.requests += w.requests
        self.finished += w.finished
        self.failed += w.failed
        self.isl_tokens += w.isl_tokens
        self.osl_tokens += w.osl_tokens
        self.cached_tokens += w.cached_tokens
        self.ttft.merge(w.ttft)
        self.itl.merge(w.itl)

    def observed(self, seconds: float) -> Observed:
        return Observed(
            request_rate=self.requests / seconds if seconds > 0 else 0.0,
            isl=self.isl_tokens / self.finished if self.finished else None,
            osl=self.osl_tokens / self.finished if self.finished else None,
            kv_hit_rate=self.cached_tokens / self.isl_tokens if self.isl_tokens else None,
            ttft_ms=self.ttft.mean(), itl_ms=self.itl.mean(),
            ttft_p90_ms=self.ttft.quantile(0.9), itl_p90_ms=self.itl.quantile(0.9))


class Observer:
    def __init__(self, model: str | None = None) -> None:
        self.model = model  # windows of other models are not this deployment's demand
        self._totals = Totals()
        self._since = time.time()
        self._reports: dict[tuple[str, int], tuple[float, LoadReport]] = {}
        self.steps: dict[str, deque[StepSample]] = {}  # pool -> step samples not yet fitted
        self._busy_ms: dict[str, float] = {}  # instance -> step time since the last take_busy
        self._busy_since = time.monotonic()
        self.windows_seen = 0

    # --- inputs ----------------------------------------------------------------------------------
    def add_window(self, w: FrontendWindow) -> None:
        if self.model is not None and w.model is not None and w.model != self.model:
            return
        self._totals.add(w)
        self.windows_seen += 1

    def add_load(self, report: LoadReport, pool: str | None, now: float | None = None) -> None:
        self._reports[(report.instance, report.dp_rank)] = (now if now is not None else time.monotonic(), report)
        if report.steps:
            self._busy_ms[report.instance] = self._busy_ms.get(report.instance, 0.0) + sum(
                st.elapsed_ms for st in report.steps)
            if pool is not None:
                self.steps.setdefault(pool, deque(maxlen=STEP_WINDOW)).extend(report.steps)

    def forget(self, instance: str) -> None:
        """A worker left the registry: its last report is no longer load."""
        for key in [k for k in self._reports if k[0] == instance]:
            del self._reports[key]

    # --- outputs ---------------------------------------------------------------------------------
    def take_interval(self, now: float | None = None) -> Observed:
        now = now if now is not None else time.time()
        obs = self._totals.observed(now - self._since)
        self._totals, self._since = Totals(), now
        return obs

    def take_busy(self, now: float | None = None) -> dict[str, float]:
        """Each instance's share of the time since the last call spent in scheduler steps (summed
        over its DP ranks, so up to dp_size)."""
        now = now if now is not None else time.monotonic()
        seconds = max(1e-3, now - self._busy_since)
        out = {inst: ms / 1000.0 / seconds for inst, ms in self._busy_ms.items()}
        self._busy_ms, self._busy_since = {}, now
        return out

    def take_steps(self, pool: str) -> list[StepSample]:
        """The pool's step samples since the last call (the regression keeps its own window)."""
        q = self.steps.get(pool)
        if not q:
            return []
        out = list(q)
        q.clear()
        return out

    def reports(self, instances: set[str], now: float | None = None) -> list[LoadReport]:
        """The fresh latest report of each rank of ``instances``."""
        now = now if now is not None else time.monotonic()
        return [r for (inst, _), (at, r) in self._reports.items()
                if inst in instances and now - at <= REPORT_STALE_S]
