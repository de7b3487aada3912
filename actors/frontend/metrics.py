"""Frontend Prometheus metrics on their own CollectorRegistry (no clash with vLLM's globals), and
the planner's per-window observations (``observations.Observations``), which travel with them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import bus.metrics
import supervisors.metrics

from .observations import Observations

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_WAKE = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_TOK = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


NO_POOL = "none"  # the pool label of a request that never reached a worker


class PoolSeries:
    """One (model, pool)'s latency children: the pool is that of the worker that produced the
    tokens (the agg pool, or the decode pool in disaggregation)."""

    __slots__ = ("duration", "ttft", "itl")

    def __init__(self, m: FrontendMetrics, model: str, pool: str) -> None:
        self.duration = m.duration.labels(model, pool)
        self.ttft = m.ttft.labels(model, pool)
        self.itl = m.itl.labels(model, pool)


class ModelSeries:
    """The per-model children of ``FrontendMetrics``' series (see ``FrontendMetrics.model``)."""

    def __init__(self, m: FrontendMetrics, name: str) -> None:
        self._m = m
        self._pools: dict[str | None, PoolSeries] = {}
        self.queued = m.queued.labels(name)
        self.inflight = m.inflight.labels(name)
        self.input_tokens = m.input_tokens.labels(name)
        self.output_tokens = m.output_tokens.labels(name)
        self.cached_tokens = m.cached_tokens.labels(name)
        self.migrations = m.migrations.labels(name)
        self.quarantined = m.quarantined.labels(name)
        self.name = name

    def pool(self, pool: str | None) -> PoolSeries:
        """The latency children of this model in ``pool`` (None: no worker was reached), resolved
        once per pool as the model's are."""
        series = self._pools.get(pool)
        if series is None:
            series = self._pools[pool] = PoolSeries(self._m, self.name, pool or NO_POOL)
        return series


class FrontendMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, prefix: str = "vllm_actors_frontend", observations: Observations | None = None,
                 extra: Sequence[CollectorRegistry] = ()) -> None:
        """``extra``: registries of other actors of this process that /metrics serves too (the
        planner's, when it runs beside the frontend)."""
        self.extra = tuple(extra)
        # per engine request (one choice of n), for the planner; the histograms below are per HTTP
        # request and take TTFT from the same start (the pipeline's t0)
        self.observations = observations if observations is not None else Observations()
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = self.prefix = prefix
        self.requests = Counter(f"{p}_requests", "HTTP requests by endpoint, model and status",
                                ["endpoint", "model", "status"], registry=r)
        self.inflight = Gauge(f"{p}_inflight_requests", "Requests being served", ["model"], registry=r)
        self.queued = Gauge(f"{p}_queued_requests", "Requests waiting for a worker (preprocess/route)",
                            ["model"], registry=r)
        # latency by model and the pool whose worker produced the tokens (ModelSeries.pool)
        self.duration = Histogram(f"{p}_request_duration_seconds", "Request duration", ["model", "pool"],
                                  buckets=_LAT, registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time to first token", ["model", "pool"],
                              buckets=_LAT, registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Time between streamed chunks, per token",
                             ["model", "pool"], buckets=_ITL, registry=r)
        self.input_tokens = Histogram(f"{p}_input_sequence_tokens", "Prompt tokens", ["model"],
                                      buckets=_TOK, registry=r)
        self.output_tokens = Histogram(f"{p}_output_sequence_tokens", "Completion tokens", ["model"],
                                       buckets=_TOK, registry=r)
        self.cached_tokens = Counter(f"{p}_cached_tokens", "Prompt tokens served from prefix cache",
                                     ["model"], registry=r)
        self.migrations = Counter(f"{p}_model_migration", "Streams re-sent to another worker", ["model"],
                                  registry=r)
        self.quarantined = Counter(f"{p}_quarantined_requests", "Requests failed and refused after the workers "
                                   "serving them died twice", ["model"], registry=r)
        self.cancellations = Counter(f"{p}_cancellations", "Worker requests cancelled", ["model"],
                                     registry=r)
        self.disconnects = Counter(f"{p}_client_disconnects", "Clients that went away mid-request",
                                   ["model"], registry=r)
        # the HTTP guard (actors.frontend.http_guard)
        self.http_connections = Gauge(f"{p}_http_connections", "Open HTTP connections", registry=r)
        self.http_refused = Counter(f"{p}_http_connections_refused",
                                    "HTTP connections refused with 503 at frontend.max_connections", registry=r)
        self.http_idle_evicted = Counter(f"{p}_http_idle_evicted", "Idle keep-alive connections closed "
                                         "to admit a new one at frontend.max_connections", registry=r)
        self.http_timeouts = Counter(f"{p}_http_timeouts", "HTTP connections closed by a timer "
                                     "(header, body: 408; keepalive: silent close when idle)", ["phase"],
                                     registry=r)
        self.http_malformed = Counter(f"{p}_http_malformed_requests",
                                      "Requests refused by the HTTP parser (400)", registry=r)

        # cold models (actors.frontend.cold): a wake's latency is the first held request's wait
        self.cold_starts = Counter(f"{p}_cold_starts", "Cold periods: a request found its model cold and "
                                   "a wake was asked for", ["model"], registry=r)
        self.wake_seconds = Histogram(f"{p}_wake_seconds", "From the first request held for a cold model to "
                                      "the model serving, by what was cold (sleep: replicas asleep; zero: "
                                      "no replica)", ["model", "cold"], buckets=_WAKE, registry=r)
        self.held = Gauge(f"{p}_held_requests", "Requests held for a cold model now", ["model"], registry=r)
        self.held_done = Counter(f"{p}_held_requests_ended", "Requests held for a cold model, by how the hold "
                                 "ended (served, failed, timeout, refused: over max_held)", ["model", "outcome"],
                                 registry=r)

        self._models: dict[str, ModelSeries] = {}
        self._requests: dict[tuple[str, str, int], Any] = {}

    def model(self, name: str) -> ModelSeries:
        """One model's label children, resolved once: a ``labels()`` lookup takes a lock and builds
        a tuple key, and a request made about fifteen of them."""
        series = self._models.get(name)
        if series is None:
            series = self._models[name] = ModelSeries(self, name)
        return series

    def request_done(self, endpoint: str, model: str, status: int) -> None:
        child = self._requests.get((endpoint, model, status))
        if child is None:
            child = self._requests[(endpoint, model, status)] = self.requests.labels(endpoint, model, str(status))
        child.inc()

    def render(self) -> bytes:
        # plus the process's supervisors and bus connection, and the default registry: the process
        # and Python collectors prometheus_client puts there
        return b"".join(generate_latest(r) for r in (self.registry, *self.extra, supervisors.metrics.REGISTRY,
                                                     bus.metrics.REGISTRY, REGISTRY))
