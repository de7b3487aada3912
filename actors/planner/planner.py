"""The planner's decisions (logic only, no NATS): from what the pools are now and what was observed,
the replicas each pool should have, why, and which children to start or stop.

One ``decide`` per interval:

1. Each managed pool asks its mode for a desired count. Throughput mode predicts the next
   interval's demand (request rate, ISL, OSL, KV hit rate; ``predictors``) and sizes the pool from
   its profile (``throughput``). Load mode fits step time on the pool's live step samples and
   simulates TTFT/ITL per engine (``load_model``): one replica more or fewer at a time.
   Scale to zero and back (``_zero``): requests a frontend holds for a cold model are load no
   engine reports, so a pool at zero replicas with held requests wants one, in both modes; and a
   pool goes to zero only when its interval saw no request, none is held and its engines run and
   queue none (``min_replicas = 0`` allows it). Load mode also lets an idle interval remove a
   replica before its step fit is ready: an idle pool has no steps to fit.
2. ``constraints`` clamps to min/max replicas and the engine budgets (total and per host).
3. A pool whose last start failed keeps its count until its start backoff has passed; a pool with a
   change still in progress is left alone (one pending change per pool).
4. The difference becomes actions: spawn the lowest free replica indices, or stop replicas
   (those not yet serving first, then the highest index).

``outcome`` records what the supervisors answered, which drives the start backoff.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.planner.constraints import PoolLimits, constrain
from actors.planner.contract import Action, Decision, Observed, PoolDecision, PoolStatus
from actors.planner.load_model import EngineLoad, StepRegression, decide
from actors.planner.perf_model import PerfModel, ProfileError, load_profile
from actors.planner.predictors import Predictor, make_predictor
from actors.planner.throughput import Demand, needed_engines, replicas_for
from bus.backoff import Backoff
from config.topology import PlannerConfig
from config.workers import MAX_REPLICA, worker_child_id

log = logging.getLogger(__name__)


@dataclass
class PoolView:
    """A pool as it is now: its root's children of it (not stopped) and its registered workers."""

    name: str
    role: str
    host: str  # the root that runs it (its supervisor subject's host token)
    engine: str
    children: list[dict[str, Any]] = field(default_factory=list)
    instances: set[str] = field(default_factory=set)  # registered engine instances
    block_size: int = 16
    known: bool = True  # False: its root did not answer, the counts are unknown

    @property
    def current(self) -> int:
        return len(self.children)

    @property
    def ready(self) -> int:
        return len(self.instances)


def _idle(observed: Observed, engines: list[EngineLoad]) -> bool:
    """An interval with frontends reporting and nothing to serve: no request started, none held,
    and every engine of the pool reporting, with nothing running or waiting."""
    return (observed.windows > 0 and observed.request_rate == 0 and observed.held == 0 and bool(engines)
            and all(e.num_running == 0 and e.num_waiting == 0 for e in engines))


def replica_of(child_id: str, pool: str) -> int | None:
    m = re.fullmatch(re.escape(worker_child_id(pool, 0))[:-1] + r"(\d+)", child_id)
    return int(m.group(1)) if m else None


@dataclass
class PoolState:
    """What the planner remembers of a pool between decisions."""

    limits: PoolLimits
    role: str
    engine: str
    profile_path: Path | None = None
    model: PerfModel | None = None
    profile_error: str | None = None
    regression: StepRegression = field(default_factory=StepRegression)
    failures: int = 0  # consecutive failed starts
    backoff_until: float = 0.0  # wall clock
    pending: str | None = None

    def load_model(self) -> None:
        if self.profile_path is None:
            return
        try:
            self.model, self.profile_error = PerfModel(load_profile(self.profile_path)), None
        except (ProfileError, OSError) as e:
            self.model, self.profile_error = None, str(e)


class Planner:
    def __init__(self, cfg: PlannerConfig, pools: dict[str, PoolState], *, instance: str = "planner") -> None:
        self.cfg = cfg
        self.pools = pools
        self.instance = instance
        self.backoff = Backoff.of(cfg.start_backoff)
        self.seq = 0
        self._predict: dict[str, Predictor] = {
            q: make_predictor(cfg.predictor, cfg.history) for q in ("request_rate", "isl", "osl", "kv_hit_rate")}
        self._fed: set[str] = set()  # quantities seen at least once
        self.last_isl: float | None = None
        self.notes: list[str] = []  # the predictors' fallbacks at the last prediction

    # --- one interval --------------------------------------------------------------------------------
    def decide(self, views: dict[str, PoolView], observed: Observed,
               loads: dict[str, list[EngineLoad]], now: float | None = None,
               predicted: Observed | None = None) -> Decision:
        """``predicted``: ``predict(observed)``'s answer (throughput mode), computed beforehand when
        the caller runs the fits off its event loop; None: computed here."""
        now = now if now is not None else time.time()
        self.seq += 1
        if observed.isl is not None:
            self.last_isl = observed.isl
        if self.cfg.mode == "throughput" and predicted is None:
            predicted = self.predict(observed)
        desired: dict[str, int] = {}
        reasons: dict[str, str] = {}
        current = {n: v.current for n, v in views.items()}
        for name, view in views.items():
            st = self.pools[name]
            if not st.limits.managed:
                desired[name], reasons[name] = view.current, (
                    "encode pool: not scaled (the planner's models measure tokens, not images)"
                    if st.role == "encode" else "not managed (planner.pools.*.managed = false)")
            elif not view.known:
                desired[name], reasons[name] = view.current, f"root {view.host} did not answer: counts unknown"
            elif self.cfg.mode == "throughput":
                desired[name], reasons[name] = self._throughput(st, view, predicted, observed.windows)
            else:
                desired[name], reasons[name] = self._load(st, view, loads.get(name, []), observed)
            if st.limits.managed and view.known:
                desired[name], reasons[name] = self._zero(view, desired[name], reasons[name], observed,
                                                          loads.get(name, []))
        constrained = constrain(desired, current, {n: s.limits for n, s in self.pools.items() if n in views},
                                self.cfg.budget, self.cfg.host_budget)
        decision = Decision(seq=self.seq, ts=now, mode=self.cfg.mode, no_op=self.cfg.no_op,
                            interval=self.cfg.effective_interval(), observed=observed, predicted=predicted,
                            notes=list(self.notes) if self.cfg.mode == "throughput" else [])
        for name, view in views.items():
            st = self.pools[name]
            target, why = constrained[name]
            if view.known and st.limits.managed:
                if target > view.current and now < st.backoff_until:
                    target, why = view.current, (f"start backoff after {st.failures} failed start(s) "
                                                 f"until {time.strftime('%H:%M:%S', time.localtime(st.backoff_until))}")
                elif target != view.current and st.pending is not None:
                    target, why = view.current, f"change in progress: {st.pending}"
            else:
                target = view.current
            decision.pools.append(PoolDecision(pool=name, role=view.role, current=view.current,
                                               ready=view.ready, desired=desired[name], target=target,
                                               reason=reasons[name], constraint=why))
            decision.actions += self._actions(view, target)
        return decision

    def predict(self, observed: Observed) -> Observed:
        """Feed this interval to the predictors; the next interval's demand. The statsmodels fits
        take tens of milliseconds: the actor runs this in a thread, one call at a time."""
        values = {"request_rate": observed.request_rate, "isl": observed.isl, "osl": observed.osl,
                  "kv_hit_rate": observed.kv_hit_rate}
        out: dict[str, float | None] = {}
        for q, v in values.items():
            if v is not None and math.isfinite(v):
                self._predict[q].add(float(v))
                self._fed.add(q)
            out[q] = self._predict[q].predict() if q in self._fed else None
        self.notes = [f"{q} predictor ({self.cfg.predictor}) fell back to the last value: {p.last_fallback}"
                      for q, p in self._predict.items() if q in self._fed and p.last_fallback]
        hit = out["kv_hit_rate"]
        return Observed(request_rate=out["request_rate"] or 0.0, isl=out["isl"], osl=out["osl"],
                        kv_hit_rate=None if hit is None else min(1.0, max(0.0, hit)))

    def _throughput(self, st: PoolState, view: PoolView, predicted: Observed | None,
                    observed_windows: int) -> tuple[int, str]:
        if st.model is None:
            return view.current, (f"no profile ({st.profile_error or 'none configured'}): run "
                                  f"python -m actors.planner.profile TOPOLOGY --pool {view.name}")
        assert predicted is not None
        if observed_windows == 0:
            # silence is not zero traffic: with no frontend reporting (frontend.observe_interval = 0,
            # the bus down) shrinking everything to the minimum would be a guess
            return view.current, "no frontend window this interval: demand unknown"
        if predicted.request_rate <= 0:
            return 0, "no requests predicted"
        if predicted.isl is None or predicted.osl is None:
            return view.current, "no finished request observed yet: ISL/OSL unknown"
        demand = Demand(request_rate=predicted.request_rate, isl=predicted.isl, osl=predicted.osl,
                        kv_hit_rate=predicted.kv_hit_rate or 0.0)
        engines, why = needed_engines(view.role, demand, st.model, self.cfg.ttft_target_ms,  # type: ignore[arg-type]
                                      self.cfg.itl_target_ms)
        n = replicas_for(engines)
        if n < view.current:
            # shrink only as far as the demand fills the smaller pool to `sensitivity`: a demand
            # near a whole number of engines (1.02, 0.98, ...) would otherwise flip the pool every
            # interval, and an engine run at the edge of its on-target rate misses the target
            held = min(view.current, replicas_for(engines / self.cfg.sensitivity))
            if held > n:
                return held, f"{why}; shrinking keeps {held} (at most {self.cfg.sensitivity:.0%} busy)"
        return n, why

    def _load(self, st: PoolState, view: PoolView, engines: list[EngineLoad],
              observed: Observed) -> tuple[int, str]:
        if st.pending is not None:
            return view.current, f"change in progress: {st.pending}"
        delta, why = decide(view.role, engines, st.regression, self.last_isl or 0.0,  # type: ignore[arg-type]
                            self.cfg.ttft_target_ms, self.cfg.itl_target_ms, self.cfg.sensitivity)
        delta, why = self._achieved(view.role, delta, why, observed)
        if delta == 0 and view.current > 0 and _idle(observed, engines):
            # with a fit, idle engines give -1 already; without one (an idle pool makes no steps
            # to fit) the pool would otherwise keep its replicas forever
            delta, why = -1, f"{why}; but the interval was idle (no request, none held, engines empty): -1"
        return max(0, view.current + delta), why

    @staticmethod
    def _zero(view: PoolView, want: int, why: str, observed: Observed,
              engines: list[EngineLoad]) -> tuple[int, str]:
        """Scale to zero and back, whatever the mode said. A pool at zero replicas with requests
        held for its cold model gets one (load mode sees no engine there, throughput mode no
        started request). A pool is taken to zero only when nothing is in it or on its way: no
        request started in the interval, none held, no engine running or queueing one."""
        if want > 0:
            return want, why
        if view.current == 0:
            if observed.held > 0:
                return 1, f"{why}; but {observed.held} request(s) held for the cold model: 1"
            return want, why
        busy = []
        if observed.request_rate > 0:
            busy.append(f"{observed.request_rate:.2f} req/s in the interval")
        if observed.held > 0:
            busy.append(f"{observed.held} request(s) held")
        inflight = sum(e.num_running + e.num_waiting for e in engines)
        if inflight:
            busy.append(f"{inflight} request(s) running or waiting on its engines")
        if busy:
            return 1, f"{why}; but {', '.join(busy)}: not to zero, keeps 1"
        return want, why

    def _achieved(self, role: str, delta: int, why: str, observed: Observed) -> tuple[int, str]:
        """The latency clients actually got over the interval overrules the simulation: a mean over
        target grows the pool even when not every engine looks over (a router's uneven share, a
        queue between two snapshots), and one not under target x sensitivity holds a shrink. TTFT
        speaks for prefill pools, ITL for decode pools, both for agg."""
        got = []
        if role in ("prefill", "agg") and observed.ttft_ms is not None:
            got.append(("TTFT", observed.ttft_ms, self.cfg.ttft_target_ms))
        if role in ("decode", "agg") and observed.itl_ms is not None:
            got.append(("ITL", observed.itl_ms, self.cfg.itl_target_ms))
        over = [f"observed mean {k} {v:.0f} ms over target {t:g}" for k, v, t in got if v > t]
        if over and delta <= 0:
            return 1, f"{why}; but {', '.join(over)}: +1"
        warm = [f"observed mean {k} {v:.0f} ms" for k, v, t in got if v >= t * self.cfg.sensitivity]
        if warm and delta < 0:
            return 0, f"{why}; but {', '.join(warm)} not under target x {self.cfg.sensitivity:g}: hold"
        return delta, why

    def _actions(self, view: PoolView, target: int) -> list[Action]:
        if target > view.current:
            taken = {c["id"] for c in view.children}
            free = [i for i in range(MAX_REPLICA + 1) if worker_child_id(view.name, i) not in taken]
            return [Action(kind="spawn", pool=view.name, child=worker_child_id(view.name, i), host=view.host)
                    for i in free[:target - view.current]]
        if target < view.current:
            # a replica not serving yet costs nothing to stop; otherwise the newest (highest index)
            order = sorted(view.children, key=lambda c: (c.get("state") == "running",
                                                         -(replica_of(c["id"], view.name) or 0)))
            return [Action(kind="stop", pool=view.name, child=c["id"], host=view.host)
                    for c in order[:view.current - target]]
        return []

    # --- outcomes ------------------------------------------------------------------------------------
    def outcome(self, action: Action, now: float | None = None) -> None:
        """A supervisor answered: a failed start backs the pool off, a good one resets it."""
        st = self.pools[action.pool]
        if action.kind != "spawn":
            return
        if action.outcome == "ok":
            st.failures, st.backoff_until = 0, 0.0
        elif action.outcome == "failed":
            st.failures += 1
            delay = self.backoff.delay(st.failures - 1)
            st.backoff_until = (now if now is not None else time.time()) + delay
            log.warning("planner: %s failed to start (%s); no new %s replica for %.0fs",
                        action.child, action.error, action.pool, delay)

    def status(self, views: dict[str, PoolView]) -> list[PoolStatus]:
        out = []
        for name, st in self.pools.items():
            v = views.get(name)
            lim = st.limits
            out.append(PoolStatus(
                pool=name, role=st.role, host=lim.host, managed=lim.managed,
                current=v.current if v else 0, ready=v.ready if v else 0,
                min_replicas=lim.min_replicas, max_replicas=lim.max_replicas,
                engines_per_replica=lim.engines_per_replica,
                children=[c["id"] for c in v.children] if v else [], start_failures=st.failures,
                backoff_until=st.backoff_until or None, pending=st.pending,
                profile=str(st.profile_path) if st.profile_path else None))
        return out
