"""The ``kv`` routing policy of the frontend: KV-cache-aware choice on the hot path, in process.

Glue between the frontend's ``Router`` interface and ``actors.router``: ``KvRouter`` (hash → match →
cost → book load) fed by a ``KvRouterFeed`` (KV events, load reports, registry). Nothing here does a
network round trip per request. The router's block size is the one the workers register (their model
card); a worker whose block size differs is costed as zero overlap, with a loud warning and a metric
(actors.router.cost) — never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence

from actors.router.cost import RouterConfig
from actors.router.feed import KvRouterFeed
from actors.router.kv_router import KvRouter
from actors.router.metrics import RouterMetrics
from bus.context import BusContext
from supervisors.topology import FrontendConfig

from .discovery import Worker, WorkerSet
from .routing import _candidates

log = logging.getLogger(__name__)

_process_metrics: RouterMetrics | None = None


def _metrics() -> RouterMetrics:
    """One set of router metrics per process, on the default registry (a restarted frontend must not
    register the same series twice)."""
    global _process_metrics
    if _process_metrics is None:
        import prometheus_client

        _process_metrics = RouterMetrics(prometheus_client.REGISTRY)
    return _process_metrics


class KvPolicy:
    name = "kv"

    def __init__(self, workers: WorkerSet, bus: BusContext, config: FrontendConfig, model: str | None) -> None:
        self.workers = workers
        self.bus = bus
        self.config = config
        self.model = model
        self.router: KvRouter | None = None
        self.feed: KvRouterFeed | None = None
        self._rr = itertools.count()
        self._init = asyncio.create_task(self._start(), name="kv-router-init")

    async def _start(self) -> None:
        """Build the router once a worker has told us its KV block size, then follow the events."""
        while True:
            sizes = {w.block_size for w in self.workers.ready_instances() if w.block_size}
            if sizes:
                break
            await asyncio.sleep(0.05)
        block_size = min(sizes)
        if len(sizes) > 1:
            log.warning("kv router: workers register different KV block sizes %s; routing with %d, the "
                        "others are costed as zero overlap", sorted(sizes), block_size)
        cfg = RouterConfig(block_size=block_size, prefill_load_scale=self.config.prefill_load_scale,
                           temperature=self.config.router_temperature,
                           busy_threshold=self.config.busy_threshold)
        mode = "kv" if self.config.kv_events else "approx"
        router = KvRouter(cfg, mode=mode, approx_ttl=self.config.approx_ttl, metrics=_metrics())
        feed = KvRouterFeed(self.bus, router, model=self.model)
        await feed.start()
        self.router, self.feed = router, feed
        log.info("kv router ready: block size %d, %s", block_size,
                 "following KV events" if mode == "kv" else
                 f"approximate mode (own decisions, {self.config.approx_ttl:g}s TTL)")

    async def aclose(self) -> None:
        self._init.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._init
        if self.feed is not None:
            await self.feed.stop()

    def choose(self, pool: Sequence[Worker], request_tokens: Sequence[int] | None,
               exclude: set[str], *, target: str | None = None, lora: str | None = None,
               request_id: str | None = None) -> Worker:
        cands = _candidates(pool, exclude, target)
        router, feed = self.router, self.feed
        if len(cands) == 1 or router is None or feed is None or not request_tokens:
            # Pinned, a single candidate, text mode, or the index is not up yet: nothing to weigh.
            return cands[next(self._rr) % len(cands)]
        by_instance = {w.instance: w for w in cands}
        ranks = [wk for wk in feed.known_workers() if wk[0] in by_instance]
        seen = {inst for inst, _ in ranks}
        ranks += [(inst, 0) for inst in by_instance if inst not in seen]  # registered, no events yet
        decision = router.route(request_tokens, ranks, request_id=request_id, lora_name=lora,
                                block_sizes=feed.block_sizes())
        return by_instance[decision.instance]

    def tokens(self, request_id: str, n: int, first: bool) -> None:
        if self.router is None:
            return
        if first:
            self.router.first_token(request_id)
        self.router.add_output_tokens(request_id, n)

    def finished(self, request_id: str) -> None:
        if self.router is not None:
            self.router.finish(request_id)


def kv_factory(config: FrontendConfig, model: str | None):
    def make(workers: WorkerSet, bus: BusContext) -> KvPolicy:
        return KvPolicy(workers, bus, config, model)

    return make
