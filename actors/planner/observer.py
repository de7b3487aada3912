"""What the planner has seen since its last decision (logic only, no NATS).

Inputs arrive from the bus as they are published: every frontend's ``FrontendWindow`` and every
worker's ``LoadReport``. ``take_interval`` sums the windows that ended since the previous call into
one ``Observed`` (rates per second of the real elapsed time, means over finished requests, latency
from the merged histograms). Held requests (a cold model's) are a level, not a count: the interval
has the sum of each frontend's latest window, not of every window. Load reports keep the latest per (instance, rank), and their step
samples go to the pool's step regression (load mode).
"""

from __future__ import annotations

import time
from collections import deque

from actors.engines.protocol import StepSample
from actors.planner.contract import FrontendWindow, Observed
from actors.worker.contract import LoadReport

# a load report older than this is a worker that stopped reporting (gone, or its bus is)
REPORT_STALE_S = 10.0
# step samples kept per pool between two decisions (the regression keeps its own window)
STEP_WINDOW = 8192


def observed(t: FrontendWindow, seconds: float, windows: int, held: int = 0) -> Observed:
    """What the ``windows`` summed in ``t`` say about an interval of ``seconds``; ``held``: the
    requests the frontends hold at its end."""
    return Observed(
        windows=windows, held=held,
        request_rate=t.requests / seconds if seconds > 0 else 0.0,
        isl=t.isl_tokens / t.finished if t.finished else None,
        osl=t.osl_tokens / t.finished if t.finished else None,
        kv_hit_rate=t.cached_tokens / t.isl_tokens if t.isl_tokens else None,
        ttft_ms=t.ttft.mean(), itl_ms=t.itl.mean(),
        ttft_p90_ms=t.ttft.quantile(0.9), itl_p90_ms=t.itl.quantile(0.9))


def _totals(now: float) -> FrontendWindow:
    return FrontendWindow(instance="", start=now, end=now)


class Observer:
    def __init__(self, model: str | None = None, *, steps: bool = True) -> None:
        """``steps``: keep the load reports' step samples (only load mode fits on them)."""
        self.model = model  # windows of other models are not this deployment's demand
        self.keep_steps = steps
        self._since = time.time()
        self._totals = _totals(self._since)
        self._windows = 0
        self._held: dict[str, tuple[float, int]] = {}  # frontend -> (end, held) of its latest window
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
        last = self._held.get(w.instance)
        if last is None or w.end >= last[0]:
            self._held[w.instance] = (w.end, w.held)
        self.windows_seen += 1
        self._windows += 1

    def add_load(self, report: LoadReport, pool: str | None, now: float | None = None) -> None:
        self._reports[(report.instance, report.dp_rank)] = (now if now is not None else time.monotonic(), report)
        if report.steps and self.keep_steps:
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
        obs = observed(self._totals, now - self._since, self._windows, sum(h for _, h in self._held.values()))
        self._totals, self._since, self._windows = _totals(now), now, 0
        self._held = {}
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
