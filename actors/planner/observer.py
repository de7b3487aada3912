"""What the planner has seen since its last decision (logic only, no NATS).

Inputs arrive from the bus as they are published: every frontend's ``FrontendWindow`` and every
worker's ``LoadReport``. ``take_interval`` sums the windows that arrived since the previous call into
one ``Observed`` (means over finished requests, latency from the merged histograms).

The request rate is each frontend's requests over the time its own windows cover, summed over the
frontends. Dividing by the planner's interval instead read twice the rate whenever two windows of
a frontend landed in one interval: the frontends' windows and the planner's decisions run on
clocks of the same period but not the same phase, and a late publish or a slow decision moves a
window across the boundary. A frontend with no window in an interval (one published late, or
lost) counts at the rate of its latest window while that window is fresh (it arrived less than
two of its lengths ago, and less than ``REPORT_STALE_S``); the interval would otherwise miss that frontend's share of the demand,
and the predictors would be fed a drop that never happened.

Held requests (a cold model's) are a level, not a count: the interval has the sum of each
frontend's latest window, not of every window. Load reports keep the latest per (instance,
rank), and their step samples go to the pool's step regression (load mode).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from actors.engines.protocol import StepSample
from actors.planner.contract import FrontendWindow, Observed
from actors.worker.contract import LoadReport

# a load report older than this is a worker that stopped reporting (gone, or its bus is); a
# frontend's window older than this no longer counts either, however long the window said it was
REPORT_STALE_S = 10.0
# step samples kept per pool between two decisions (the regression keeps its own window)
STEP_WINDOW = 8192


@dataclass
class FrontendRate:
    """One frontend's requests and the seconds its windows covered since the last interval, and
    its latest window (what an interval without a window of it counts)."""

    requests: int = 0
    seconds: float = 0.0
    rate: float = 0.0  # requests per second of its windows of the last interval that had any
    # when its latest window arrived (the planner's clock: a frontend host's clock may be off) and
    # how long that window was
    arrived: float = 0.0
    span: float = 0.0

    def add(self, w: FrontendWindow, now: float) -> None:
        self.requests += w.requests
        self.seconds += max(0.0, w.end - w.start)
        self.arrived, self.span = now, max(0.0, w.end - w.start)

    def take(self, now: float) -> float | None:
        """Its rate over the interval; None: no fresh window, it no longer counts."""
        if self.seconds > 0:
            self.rate = self.requests / self.seconds
        elif now - self.arrived >= min(2 * self.span, REPORT_STALE_S):
            return None
        self.requests, self.seconds = 0, 0.0
        return self.rate


def observed(t: FrontendWindow, request_rate: float, windows: int, held: int = 0) -> Observed:
    """What the ``windows`` summed in ``t`` say about an interval in which the frontends saw
    ``request_rate`` requests per second; ``held``: the requests they hold at its end."""
    return Observed(
        windows=windows, held=held, request_rate=request_rate,
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
        self._totals = _totals(time.time())
        self._windows = 0
        self._held: dict[str, tuple[float, int]] = {}  # frontend -> (end, held) of its latest window
        self._rates: dict[str, FrontendRate] = {}  # frontend -> its requests and the time they cover
        self._reports: dict[tuple[str, int], tuple[float, LoadReport]] = {}
        self.steps: dict[str, deque[StepSample]] = {}  # pool -> step samples not yet fitted
        self._busy_ms: dict[str, float] = {}  # instance -> step time since the last take_busy
        self._busy_since = time.monotonic()
        self.windows_seen = 0

    # --- inputs ----------------------------------------------------------------------------------
    def add_window(self, w: FrontendWindow, now: float | None = None) -> None:
        if self.model is not None and w.model is not None and w.model != self.model:
            return
        self._totals.add(w)
        self._rates.setdefault(w.instance, FrontendRate()).add(w, now if now is not None else time.time())
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
        rates = {f: r.take(now) for f, r in self._rates.items()}
        for f in [f for f, rate in rates.items() if rate is None]:
            del self._rates[f]
        obs = observed(self._totals, sum(rate for rate in rates.values() if rate is not None), self._windows,
                       sum(h for _, h in self._held.values()))
        self._totals, self._windows = _totals(now), 0
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
