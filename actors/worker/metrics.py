"""Prometheus metrics of one worker, and the load reports the router and planner read.

Each ``WorkerMetrics`` owns its own CollectorRegistry, so several engine actors in one test process
do not collide on metric names. ``render()`` exports that registry together with vLLM's own
``vllm:*`` series: from the global registry in-process, or — when ``PROMETHEUS_MULTIPROC_DIR`` is set
(several processes share one scrape target) — through prometheus_client's MultiProcessCollector.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

import bus.metrics
import supervisors.metrics
from actors.engines.protocol import EngineStats, StepSample
from actors.worker.contract import LoadReport

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class WorkerMetrics:
    """Request and KV metrics of one worker, labelled with its instance as ``worker_id`` (not
    ``instance``: Prometheus sets that label on every scraped series, and a scrape renames ours
    to ``exported_instance``) and its model."""

    def __init__(self, instance: str, model: str, registry: CollectorRegistry | None = None) -> None:
        self.instance = instance
        self.model = model
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        base = ["worker_id", "model", "endpoint"]
        self.requests = Counter("vllm_actors_worker_requests", "Requests handled, by endpoint and status",
                                [*base, "status"], registry=r)
        self.duration = Histogram("vllm_actors_worker_request_duration_seconds", "Request duration by endpoint",
                                  base, buckets=_DURATION_BUCKETS, registry=r)
        self.in_flight = Gauge("vllm_actors_worker_inflight_requests", "Requests being handled", base, registry=r)
        self.cancellations = Counter("vllm_actors_worker_cancellations", "Requests aborted before finishing",
                                     [*base, "reason"], registry=r)
        self._by_endpoint: dict[str, tuple[Any, Any]] = {}
        self._by_status: dict[tuple[str, str], Any] = {}
        kv = ["worker_id", "model", "dp_rank"]
        self.kv_total = Gauge("vllm_actors_worker_kv_total_blocks", "KV cache blocks in the pool", kv, registry=r)
        self.kv_usage = Gauge("vllm_actors_worker_kv_usage_perc", "KV cache usage fraction (0..1)", kv, registry=r)
        self.kv_active = Gauge("vllm_actors_worker_kv_active_blocks", "KV blocks held by requests", kv, registry=r)
        self.prefix_hit_rate = Gauge("vllm_actors_worker_prefix_cache_hit_rate", "Prefix cache hit rate (cumulative)",
                                     kv, registry=r)
        self.num_running = Gauge("vllm_actors_worker_num_requests_running", "Running requests in the scheduler", kv, registry=r)
        self.num_waiting = Gauge("vllm_actors_worker_num_requests_waiting", "Waiting requests in the scheduler", kv, registry=r)

    def _labels(self, endpoint: str) -> dict[str, str]:
        return {"worker_id": self.instance, "model": self.model, "endpoint": endpoint}

    def _children(self, endpoint: str) -> tuple[Any, Any]:
        """(in flight, duration) of an endpoint, resolved once: ``labels()`` takes a lock and builds a
        key, and every generate request used to make four such lookups."""
        pair = self._by_endpoint.get(endpoint)
        if pair is None:
            labels = self._labels(endpoint)
            pair = self._by_endpoint[endpoint] = (self.in_flight.labels(**labels), self.duration.labels(**labels))
        return pair

    def _count(self, endpoint: str, status: str) -> None:
        child = self._by_status.get((endpoint, status))
        if child is None:
            child = self._by_status[(endpoint, status)] = self.requests.labels(**self._labels(endpoint), status=status)
        child.inc()

    @contextmanager
    def track(self, endpoint: str) -> Iterator[None]:
        """Count one request: in-flight while inside, duration and status on exit."""
        in_flight, duration = self._children(endpoint)
        in_flight.inc()
        t0 = time.monotonic()
        status = "ok"
        try:
            yield
        except GeneratorExit:
            status = "cancelled"
            raise
        except BaseException as e:  # noqa: B036 - status label only; always re-raised
            status = type(e).__name__
            raise
        finally:
            in_flight.dec()
            duration.observe(time.monotonic() - t0)
            self._count(endpoint, status)

    def cancelled(self, endpoint: str, reason: str) -> None:
        """reason: "cancel" (explicit), "caller_gone", "shutdown", "engine_dead", "sleep"."""
        self.cancellations.labels(**self._labels(endpoint), reason=reason).inc()

    def update_engine(self, stats: list[EngineStats]) -> None:
        for s in stats:
            kv = {"worker_id": self.instance, "model": self.model, "dp_rank": str(s.dp_rank)}
            self.kv_total.labels(**kv).set(s.total_kv_blocks)
            self.kv_usage.labels(**kv).set(s.kv_usage)
            self.kv_active.labels(**kv).set(s.active_kv_blocks)
            self.prefix_hit_rate.labels(**kv).set(s.prefix_hit_rate)
            self.num_running.labels(**kv).set(s.num_running)
            self.num_waiting.labels(**kv).set(s.num_waiting)

    def render(self) -> tuple[bytes, str]:
        """Body and content type for /metrics: ours, the process's supervisors and bus connection,
        plus vLLM's own series."""
        return generate_latest(self.registry) + process_metrics() + engine_metrics(), CONTENT_TYPE_LATEST


def process_metrics() -> bytes:
    """The worker process's supervisor (restarts, children) and bus connection: shown whether or
    not an engine actor runs (one restarting is when they matter)."""
    return generate_latest(supervisors.metrics.REGISTRY) + generate_latest(bus.metrics.REGISTRY)


def engine_metrics() -> bytes:
    """vLLM's (and anything else's) metrics in the default registry, multiprocess-safe."""
    mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if mp_dir and os.path.isdir(mp_dir):
        from prometheus_client import multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=mp_dir)
        return generate_latest(reg)
    return generate_latest(REGISTRY)


def load_reports(instance: str, stats: list[EngineStats], now: float | None = None,
                 steps: list[StepSample] | None = None, idle_s: float | None = None) -> list[LoadReport]:
    """One LoadReport per DP rank from the engine's latest stats, each with that rank's ``steps``
    (the samples taken since the previous reports; those of a rank without stats are dropped) and
    the worker's ``idle_s``."""
    ts = time.time() if now is None else now
    by_rank: dict[int, list[StepSample]] = {}
    for step in steps or ():
        by_rank.setdefault(step.dp_rank, []).append(step)
    return [LoadReport(instance=instance, dp_rank=s.dp_rank, num_running=s.num_running,
                       num_waiting=s.num_waiting, kv_usage=s.kv_usage,
                       active_kv_blocks=s.active_kv_blocks, total_kv_blocks=s.total_kv_blocks,
                       prefix_hit_rate=s.prefix_hit_rate, ts=ts, steps=by_rank.get(s.dp_rank, []),
                       idle_s=idle_s)
            for s in stats]
