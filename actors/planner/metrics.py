"""The planner's Prometheus series, on a registry of its own (served by the frontend's ``/metrics``
when both run in one process; ``nats req <ns>.planner.status`` has the same facts everywhere).

The registry outlives a restarted planner actor (the deployment builds it once), so counters keep
counting across planner restarts the way a scrape expects."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from actors.planner.contract import Action, Decision

_QUANTITIES = ("request_rate", "isl", "osl", "kv_hit_rate", "ttft_ms", "itl_ms", "ttft_p90_ms", "itl_p90_ms")


class PlannerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.replicas = Gauge("vllm_actors_planner_replicas", "Replicas per pool at the last decision: current (the "
                              "supervisors run), ready (registered), desired (the mode asked), target "
                              "(after constraints)", ["pool", "kind"], registry=r)
        self.decisions = Counter("vllm_actors_planner_decisions", "Decisions taken", registry=r)
        self.actions = Counter("vllm_actors_planner_scale_actions", "Spawns and stops the planner asked the supervisors for",
                               ["pool", "kind", "outcome"], registry=r)
        self.observed = Gauge("vllm_actors_planner_observed", "What the planner observed over its last interval",
                              ["quantity"], registry=r)
        self.predicted = Gauge("vllm_actors_planner_predicted", "Throughput mode: the next interval's predicted demand",
                               ["quantity"], registry=r)

    def decided(self, d: Decision) -> None:
        self.decisions.inc()
        for p in d.pools:
            for kind in ("current", "ready", "desired", "target"):
                self.replicas.labels(p.pool, kind).set(getattr(p, kind))
        for q in _QUANTITIES:
            v = getattr(d.observed, q, None)
            if v is not None:
                self.observed.labels(q).set(v)
            if d.predicted is not None and (pv := getattr(d.predicted, q, None)) is not None:
                self.predicted.labels(q).set(pv)

    def acted(self, a: Action) -> None:
        self.actions.labels(a.pool, a.kind, a.outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
