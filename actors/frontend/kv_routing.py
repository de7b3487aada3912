"""The ``kv`` routing policy of the frontend: KV-cache-aware choice on the hot path, in process.

Glue between the frontend's ``Router`` interface and ``actors.router``: ``KvRouter`` (hash → match →
cost → book load and predicted blocks) fed by a ``KvRouterFeed`` (KV events, load reports, and the
frontend's own watch of the registry: one watch per process). Nothing here does a network round
trip per request. The router's block size is the one the workers register (``block_size`` of
their instance record); a worker whose block size differs is costed as zero overlap, with a loud warning and a metric
(actors.router.cost) — never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry

from actors.instances.contract import InstanceRecord
from actors.instances.watch import RETRY, BucketWatch
from actors.kv.hashing import MmSpan
from actors.router.cost import RouterConfig, RoutingDecision
from actors.router.feed import KvRouterFeed
from actors.router.kv_router import KvRouter
from actors.router.metrics import RouterMetrics
from actors.router.service import RouterState
from bus.context import BusContext
from bus.tasks import cancel_and_wait
from config.topology import FrontendConfig

from .discovery import Worker, WorkerSet
from .routing import _candidates
from .shared_view import SharedRoutingView

log = logging.getLogger(__name__)


class KvPolicy:
    """The frontend's KV router: the process's only one (the ``ns.router.*`` endpoints serve it too).

    It exists from the first moment a worker of the model is known with a KV block size: built
    synchronously (from a registry change or the first ``choose``), while its feed starts in the
    background. Decisions made before the feed is up are booked as predicted blocks and survive the
    feed's bootstrap, which merges each worker's dump into the router. Round robin remains only
    while no block size is known, and for text-mode requests (no token ids to hash).
    """

    name = "kv"

    def __init__(self, workers: WorkerSet, bus: BusContext, instances: BucketWatch[InstanceRecord],
                 config: FrontendConfig, model: str | None, registry: CollectorRegistry | None = None,
                 share_as: str | None = None) -> None:
        """``share_as``: this frontend's instance, when its bookings are shared with other frontends
        (``actors.frontend.shared_view``: several frontend processes)."""
        self.workers = workers
        # on the frontend's own registry, which its /metrics exports (a private one when none is given)
        self.metrics = RouterMetrics(registry)
        self.bus = bus
        self.instances = instances
        self.config = config
        self.model = model
        self.router: KvRouter | None = None
        self.feed: KvRouterFeed | None = None
        self.last_decision: RoutingDecision | None = None
        self.feed_started = asyncio.Event()
        self._feed_task: asyncio.Task[None] | None = None
        self._rr = itertools.count()
        self.share_as = share_as
        self.shared: SharedRoutingView | None = None
        self._unwatch: Callable[[], None] | None = None
        workers.listeners.append(self._on_workers)
        self._on_workers()

    def current(self) -> RouterState | None:
        """The router and its feed, or None while no worker has registered a KV block size."""
        router, feed = self.router, self.feed
        return (router, feed) if router is not None and feed is not None else None

    def _on_workers(self) -> None:
        if self.router is None:
            self._ensure([w for w in self.workers.ready_instances()
                          if self.model is None or w.model == self.model])

    def _ensure(self, workers: Sequence[Worker]) -> KvRouter | None:
        """Build the router now if these workers tell a KV block size; start its feed in the background."""
        if self.router is not None:
            return self.router
        sizes = {w.block_size for w in workers if w.block_size}
        if not sizes:
            return None
        block_size = min(sizes)
        if len(sizes) > 1:
            log.warning("kv router: workers register different KV block sizes %s; routing with %d, the "
                        "others are costed as zero overlap", sorted(sizes), block_size)
        cfg = RouterConfig(block_size=block_size, prefill_load_scale=self.config.prefill_load_scale,
                           temperature=self.config.router_temperature,
                           busy_threshold=self.config.busy_threshold)
        mode = "kv" if self.config.kv_events else "approx"
        router = KvRouter(cfg, mode=mode, approx_ttl=self.config.approx_ttl, metrics=self.metrics,
                          session_ttl=self.config.session_affinity_ttl)
        found = self.workers.resolve_model(self.model) if self.model is not None else None
        if found is not None:  # the card's KV capacity sizes the latency model's defaults
            card = found[0].card
            router.latency.set_default_capacity(card.total_kv_blocks * card.kv_block_size or None)
        feed = KvRouterFeed(self.bus, router, model=self.model, instances=self.instances)
        self.router, self.feed = router, feed
        if self.share_as is not None:
            shared = self.shared = SharedRoutingView(self.bus, router, self.share_as)
            # a frontend whose record goes (stopped, or SIGKILLed and expired) books nothing any more
            self._unwatch = self.instances.subscribe(lambda _k, _v: None, shared.forget_origin)
        self._feed_task = asyncio.get_running_loop().create_task(self._start_feed(feed),
                                                                 name="kv-router-feed-start")
        log.info("kv router built: block size %d, %s cost, %s", block_size,
                 "weighted" if cfg.prefill_load_scale is not None else "predicted-latency",
                 "following KV events (feed starting)" if mode == "kv" else
                 f"approximate mode (own decisions, {self.config.approx_ttl:g}s TTL)")
        return router

    async def _start_feed(self, feed: KvRouterFeed) -> None:
        if self.shared is not None:  # before the feed's bootstrap: a peer's bookings meanwhile count
            for attempt in itertools.count():
                try:
                    await self.shared.start()
                    break
                except Exception as e:  # noqa: BLE001 - bookings are shared once the bus answers
                    await self.shared.stop()  # no half-made subscription left behind
                    delay = RETRY.delay(attempt)
                    log.warning("kv router: cannot subscribe to other frontends' bookings (%s); retrying "
                                "in %.1fs", e, delay)
                    await asyncio.sleep(delay)
        for attempt in itertools.count():
            try:
                await feed.start()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the router keeps routing on its own decisions meanwhile
                delay = RETRY.delay(attempt)
                log.warning("kv router: feed failed to start (%s); retrying in %.1fs", e, delay)
                await feed.stop()
                await asyncio.sleep(delay)
                continue
            self.feed_started.set()
            return

    async def aclose(self) -> None:
        with contextlib.suppress(ValueError):
            self.workers.listeners.remove(self._on_workers)
        if self._feed_task is not None:
            await cancel_and_wait([self._feed_task])
        if self.feed is not None:
            await self.feed.stop()
        if self._unwatch is not None:
            self._unwatch()
        if self.shared is not None:
            await self.shared.stop()

    def choose(self, pool: Sequence[Worker], request_tokens: Sequence[int] | None,
               exclude: set[str], *, target: str | None = None, lora: str | None = None,
               request_id: str | None = None, mm: Sequence[MmSpan] | None = None,
               session: str | None = None) -> Worker:
        cands = _candidates(pool, exclude, target)
        router = self.router or self._ensure(cands)
        feed = self.feed
        self.last_decision = None
        if router is None or feed is None or not request_tokens:
            # No block size known yet, or text mode: nothing to hash.
            return cands[next(self._rr) % len(cands)]
        by_instance = {w.instance: w for w in cands}
        ranks = [wk for wk in feed.known_workers() if wk[0] in by_instance]
        seen = {inst for inst, _ in ranks}
        ranks += [(inst, 0) for inst in by_instance if inst not in seen]  # the feed has not seen it yet
        if target is not None or len(ranks) == 1:
            # Nothing to choose, but still booked: the next request of this session builds on it.
            router.pin(request_tokens, ranks[0], request_id=request_id, lora_name=lora, mm=mm)
            return cands[0]
        sizes = feed.block_sizes() or {(w.instance, 0): w.block_size for w in cands}
        decision = self.last_decision = router.route(request_tokens, ranks, request_id=request_id, lora_name=lora,
                                                     block_sizes=sizes, mm=mm, session=session)
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
