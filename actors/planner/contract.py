"""Wire contract of the SLA planner: what it observes, what it decides, and the profile it reads.

- ``FrontendWindow``: each frontend publishes one per ``frontend.observe_interval`` on
  ``Subjects.metrics_frontend(instance)`` (JSON, so ``nats sub`` shows it as it is).
- Workers' ``LoadReport``s (``actors.worker.contract``) carry per-step timings (``StepSample``).
- ``Decision``: published on ``Subjects.planner_decision()`` every interval and kept for the
  ``decisions`` verb; ``PlannerStatus`` answers ``status``.
- ``Profile``: the file ``python -m actors.planner.profile`` writes and throughput mode reads.

Histograms are cumulative-free (a count per bucket) so windows from several frontends merge by
adding counts.
"""

from __future__ import annotations

import bisect
from typing import Literal

import msgspec

VERB_STATUS = "status"
VERB_DECISIONS = "decisions"
VERB_PROFILE = "profile"
VERBS = (VERB_STATUS, VERB_DECISIONS, VERB_PROFILE)

PLANNER_KIND = "planner"  # the actor's kind in the registry and its micro service name

# bucket upper bounds (ms); the last bucket of a histogram is everything above the last bound
TTFT_BOUNDS_MS: tuple[float, ...] = (10, 25, 50, 75, 100, 150, 200, 300, 400, 500, 650, 800, 1000,
                                     1500, 2000, 3000, 5000, 10000, 30000)
ITL_BOUNDS_MS: tuple[float, ...] = (1, 2, 5, 10, 15, 20, 25, 30, 40, 50, 60, 75, 100, 150, 200,
                                    300, 500, 1000)


class Histogram(msgspec.Struct, kw_only=True):
    """Latencies in ms: ``counts[i]`` observations <= ``bounds_ms[i]`` (and above the one before);
    ``counts[-1]`` those above the last bound."""

    bounds_ms: list[float]
    counts: list[int]
    sum_ms: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds_ms=list(bounds), counts=[0] * (len(bounds) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, ms: float, n: int = 1) -> None:
        """``n`` observations of ``ms`` (a chunk of n tokens: each its share of the gap)."""
        self.counts[bisect.bisect_left(self.bounds_ms, ms)] += n
        self.sum_ms += ms * n

    def merge(self, other: Histogram) -> None:
        if other.bounds_ms != self.bounds_ms:
            raise ValueError("histograms with different buckets do not merge")
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum_ms += other.sum_ms

    def mean(self) -> float | None:
        n = self.count
        return self.sum_ms / n if n else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile, linearly interpolated within its bucket (the overflow bucket answers
        with the last bound: a lower bound of the truth)."""
        n = self.count
        if not n:
            return None
        rank = q * n
        seen = 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                if i == len(self.bounds_ms):
                    return self.bounds_ms[-1]
                lo = self.bounds_ms[i - 1] if i else 0.0
                return lo + (self.bounds_ms[i] - lo) * max(0.0, rank - seen) / c
            seen += c
        return self.bounds_ms[-1]


class FrontendWindow(msgspec.Struct, kw_only=True):
    """One frontend's engine requests over ``[start, end)`` (wall clock). A request is one engine
    request (one choice of ``n``); ``requests`` counts those that started in the window, the token
    sums those that finished in it."""

    instance: str
    model: str | None = None
    start: float
    end: float
    requests: int = 0
    finished: int = 0
    failed: int = 0
    isl_tokens: int = 0  # prompt tokens of the finished requests
    osl_tokens: int = 0  # generated tokens of the finished requests
    cached_tokens: int = 0  # prompt tokens the serving engine found cached
    # requests held for a cold model at the window's end (not started yet: they are not in
    # ``requests`` until their model serves again)
    held: int = 0
    ttft: Histogram = msgspec.field(default_factory=lambda: Histogram.empty(TTFT_BOUNDS_MS))
    itl: Histogram = msgspec.field(default_factory=lambda: Histogram.empty(ITL_BOUNDS_MS))

    def add(self, w: FrontendWindow) -> None:
        """Add another window's counts (windows of several frontends, or of several intervals)."""
        self.start, self.end = min(self.start, w.start), max(self.end, w.end)
        self.requests += w.requests
        self.finished += w.finished
        self.failed += w.failed
        self.isl_tokens += w.isl_tokens
        self.osl_tokens += w.osl_tokens
        self.cached_tokens += w.cached_tokens
        self.held += w.held
        self.ttft.merge(w.ttft)
        self.itl.merge(w.itl)


# --- decisions -------------------------------------------------------------------------------------
class Observed(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the planner saw over its last interval (None: nothing to see, e.g. no traffic)."""

    windows: int = 0  # frontend windows the interval was made of (0: no frontend reported at all)
    request_rate: float = 0.0  # engine requests per second
    isl: float | None = None  # mean prompt tokens
    osl: float | None = None  # mean generated tokens
    kv_hit_rate: float | None = None  # cached / prompt tokens
    ttft_ms: float | None = None  # mean
    itl_ms: float | None = None  # mean
    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    # requests held for a cold model at the interval's end (each frontend's latest window): demand
    # that no engine sees yet, so a pool at zero replicas is grown for it
    held: int = 0


class Action(msgspec.Struct, kw_only=True):
    kind: Literal["spawn", "stop"]
    pool: str
    child: str
    host: str
    outcome: Literal["ok", "failed", "planned"] = "planned"  # planned: no-op mode, or not yet done
    error: str | None = None
    seconds: float | None = None  # how long the supervisor took


class PoolDecision(msgspec.Struct, kw_only=True, omit_defaults=True):
    pool: str
    role: str
    current: int  # replicas the supervisors run (their children views) when deciding
    ready: int  # of which registered and serving
    desired: int  # what the mode asked for, before constraints
    target: int  # after min/max replicas, budgets and start backoff
    reason: str  # why desired, in words (numbers included)
    constraint: str | None = None  # what moved target away from desired


class Decision(msgspec.Struct, kw_only=True, omit_defaults=True):
    seq: int
    ts: float
    mode: Literal["throughput", "load"]
    no_op: bool
    interval: float
    observed: Observed
    predicted: Observed | None = None  # throughput mode: the next interval's demand
    pools: list[PoolDecision] = []
    actions: list[Action] = []
    notes: list[str] = []  # e.g. a predictor that fell back to the last value, and why


class PoolStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    pool: str
    role: str
    host: str
    managed: bool
    current: int
    ready: int
    min_replicas: int
    max_replicas: int | None  # None: only the budgets bound it
    engines_per_replica: int
    children: list[str] = []  # the root's child ids of this pool's workers
    start_failures: int = 0  # consecutive failed starts
    backoff_until: float | None = None  # wall clock; no new replica before it
    pending: str | None = None  # the change in progress ("spawn worker-decode-2")
    profile: str | None = None  # the profile file throughput mode uses


class PlannerStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    instance: str
    mode: Literal["throughput", "load"]
    no_op: bool
    interval: float
    ttft_target_ms: float
    itl_target_ms: float
    budget: int
    engines: int  # engines the managed and unmanaged pools occupy now
    predictor: str
    pools: list[PoolStatus] = []
    last_decision: Decision | None = None
    # the planner keeps cold pools too (``wake.PoolKeeper``): pool -> the wake or idle stop running
    # now, and the last outcomes (as a waker's status has them)
    wake_pending: dict[str, str] = {}
    wakes: list[WakeOutcome] = []


class DecisionsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    limit: int = 20  # the newest this many, oldest first


class ProfileRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pool: str | None = None  # None: a summary of every pool's profile


# --- profile ---------------------------------------------------------------------------------------
class PrefillPoint(msgspec.Struct, kw_only=True):
    """``concurrency`` requests of ``isl`` uncached prompt tokens kept in flight on one engine."""

    isl: int
    concurrency: int
    ttft_ms: float  # mean time to first token
    tokens_per_s: float  # prompt tokens the engine prefilled per second


class DecodePoint(msgspec.Struct, kw_only=True):
    """``concurrency`` requests decoding with ``context`` tokens each on one engine."""

    context: int
    concurrency: int
    itl_ms: float  # mean inter-token latency
    tokens_per_s: float  # generated tokens per second, all requests together


PROFILE_VERSION = 1


class Profile(msgspec.Struct, kw_only=True):
    """One pool's measured performance, per engine (``python -m actors.planner.profile``)."""

    version: int = PROFILE_VERSION
    pool: str
    role: str
    engine: str  # vllm | mocker
    model: str
    made_by: str  # the command line that measured it
    made_at: float  # wall clock
    engines_per_replica: int = 1
    kv_capacity_tokens: int  # KV cache of one engine, in tokens
    max_num_seqs: int  # running requests one engine admits
    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []


def profile_summary(p: Profile) -> dict[str, object]:
    """What ``profile`` answers per pool without ``pool``: where it came from and its ranges."""
    return {"pool": p.pool, "role": p.role, "engine": p.engine, "model": p.model,
            "made_by": p.made_by, "made_at": p.made_at, "kv_capacity_tokens": p.kv_capacity_tokens,
            "max_num_seqs": p.max_num_seqs, "prefill_points": len(p.prefill),
            "decode_points": len(p.decode),
            "isl_range": [min((x.isl for x in p.prefill), default=0), max((x.isl for x in p.prefill), default=0)],
            "max_decode_concurrency": max((x.concurrency for x in p.decode), default=0)}


# --- cold models: demand and wake outcomes (actors.planner.wake) ------------------------------------
class Demand(msgspec.Struct, kw_only=True):
    """A frontend holds requests for ``model``, which no worker serves now (its pools asleep or at
    zero replicas). Published on ``Subjects.wake_demand()`` once per cold period and frontend
    process (JSON, so ``nats sub`` shows it as it is)."""

    model: str
    frontend: str
    held: int = 1  # requests held when it was sent
    wake_timeout: float = 120.0  # how long the frontend holds them: the waker gives up after it
    ts: float = 0.0


WakeAction = Literal["wake", "spawn", "stop"]


class WakeOutcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a waker did for a pool: woke a sleeping replica (``wake``), started one in a pool at
    zero (``spawn``), or removed an idle one (``stop``, idle_stop). Published on
    ``Subjects.wake_outcome()``; a frontend ends its held requests with ``error`` when a wake
    failed."""

    pool: str
    action: WakeAction
    outcome: Literal["ok", "failed"]
    model: str | None = None
    target: str = ""  # the instance woken, or the child started or stopped
    host: str = ""  # the root that runs the pool
    error: str | None = None
    seconds: float = 0.0  # from the demand (or the stop) to the answer
    by: str = ""  # the waker's (or planner's) instance
    ts: float = 0.0


class WakerStatus(msgspec.Struct, kw_only=True):
    """``<ns>.waker.<host>.status``: the pools a waker keeps, what runs now, the last outcomes."""

    instance: str
    pools: dict[str, dict[str, object]]
    pending: dict[str, str]  # pool -> what runs for it now
    recent: list[WakeOutcome]
