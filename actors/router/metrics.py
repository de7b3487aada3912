"""Prometheus metrics of the KV router.

Created on an explicit registry: pass the registry your /metrics endpoint exports (e.g.
``prometheus_client.REGISTRY``). With ``None`` a private registry is used, so several routers in
one test process never collide on metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.hashing_seconds = Histogram("vllm_actors_router_hashing_seconds", "Time to hash a request's blocks",
                                         buckets=_FAST_BUCKETS, registry=reg)
        self.matching_seconds = Histogram("vllm_actors_router_matching_seconds", "Time of find_matches",
                                          buckets=_FAST_BUCKETS, registry=reg)
        self.scheduling_seconds = Histogram("vllm_actors_router_scheduling_seconds",
                                            "Time to compute costs and pick a worker",
                                            buckets=_FAST_BUCKETS, registry=reg)
        self.events_applied = Counter("vllm_actors_router_kv_events_applied_total",
                                      "KV events applied to the index", ["kind"], registry=reg)
        self.event_gaps = Counter("vllm_actors_router_kv_event_gaps_total",
                                  "Gaps detected in a worker's KV event ids", registry=reg)
        self.index_blocks = Gauge("vllm_actors_router_kv_index_blocks",
                                  "Distinct sequence hashes in the index", registry=reg)
        self.predicted_blocks = Gauge(
            "vllm_actors_router_predicted_blocks",
            "(block, worker) pairs assumed cached from routing decisions, not yet confirmed by KV events",
            registry=reg)
        self.block_size_mismatch = Counter(
            "vllm_actors_router_block_size_mismatch_total",
            "Events or routing decisions involving a worker whose block size differs from the router's",
            ["worker_id", "source"], registry=reg)
        self.request_blocks = Counter("vllm_actors_router_request_blocks_total",
                                      "Full prompt blocks of routed requests", registry=reg)
        self.hit_blocks = Counter("vllm_actors_router_hit_blocks_total",
                                  "Prompt blocks already cached on the chosen worker", registry=reg)
        self.hit_rate = Gauge("vllm_actors_router_prefix_hit_rate",
                              "Cumulative hit_blocks / request_blocks", registry=reg)
        self.decisions = Counter("vllm_actors_router_decisions_total", "Routing decisions", ["mode"], registry=reg)
        self.session_affinity = Counter(
            "vllm_actors_router_session_affinity_total",
            "Requests naming a session (x-dynamo-session-id): kept on its bound worker, moved off an "
            "overloaded or gone one, or the session's first", ["outcome"], registry=reg)
        self.predicted_ttft = Histogram(
            "vllm_actors_router_predicted_ttft_seconds", "The latency model's TTFT prediction for the chosen worker",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=reg)
        error = Gauge(
            "vllm_actors_router_ttft_prediction_error_seconds",
            "The latency model's TTFT error (actual - predicted, newest ~100 requests): its mean (bias) and "
            "standard deviation (spread, the temperature the router samples equally cached workers with)",
            ["stat"], registry=reg)
        self.error_bias, self.error_spread = error.labels("bias"), error.labels("spread")
        self._req = 0
        self._hit = 0

    def observe_hit(self, request_blocks: int, hit_blocks: int) -> None:
        self.request_blocks.inc(request_blocks)
        self.hit_blocks.inc(hit_blocks)
        self._req += request_blocks
        self._hit += hit_blocks
        if self._req:
            self.hit_rate.set(self._hit / self._req)
