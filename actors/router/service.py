"""Router micro service: a KvRouter + KvRouterFeed reachable over NATS (CLI, planners, frontends).

Endpoints (JSON without headers works, as ``nats req`` sends it; msgpack by Content-Type):

* ``Subjects.router("route")`` — :class:`RouteRequest` → the decision
  ``{instance, dp_rank, overlap_blocks, cost, request_blocks, costs, excluded_busy, mode}``.
  ``workers`` defaults to every live worker in the registry (of ``role`` when given). The request's
  load is *not* booked unless ``book`` is true (a CLI or planner query must not leave phantom load
  behind); a booked request is released with ``finish`` (its ``request_id``).
* ``Subjects.router("finish")`` — ``{request_id}``: release a booked request's load.
* ``Subjects.router("index.stats")`` — index, load and feed counters.
* ``Subjects.router("index.dump")`` — ``{instance?, limit?}`` → blocks per worker (hashes).

The frontend's hot path does not come here: it runs its own KvRouter + KvRouterFeed in process.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from actors.base import Actor, Endpoint
from actors.router.cost import RouterConfig
from actors.router.feed import KvRouterFeed
from actors.router.index import KvIndex
from actors.router.kv_router import KvRouter
from bus.context import BusContext
from bus.errors import BadRequest, Overloaded

log = logging.getLogger(__name__)

Worker = tuple[str, int]


class RouteRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    token_ids: list[int]
    # "instance" (rank 0 .. dp_size-1 from the registry), "instance/rank", or [instance, rank]
    workers: list[str | tuple[str, int]] | None = None
    role: str | None = None
    lora_name: str | None = None
    salt: str | None = None
    request_id: str | None = None
    book: bool = False


class FinishRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str


class DumpRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    instance: str | None = None
    limit: int | None = None  # at most this many hashes per worker


class RouterService(Actor):
    kind: ClassVar[str] = "router"
    description: ClassVar[str] = "KV-aware router: route, index stats and dump"
    version: ClassVar[str] = "0.1.0"

    def __init__(self, bus: BusContext, router: KvRouter | None = None, *, block_size: int | None = None,
                 config: RouterConfig | None = None, feed: KvRouterFeed | None = None,
                 recovery_timeout: float = 10.0, instance: str | None = None, model: str = "",
                 register: bool = True) -> None:
        super().__init__(bus, instance=instance or f"router-{secrets.token_hex(4)}", role="router",
                         model=model, register=register)
        if router is None:
            if config is None:
                if block_size is None:
                    raise ValueError("RouterService needs a router, a config or a block_size")
                config = RouterConfig(block_size=block_size)
            router = KvRouter(config)
        self.router = router
        self._own_feed = feed is None
        # With a model, only that model's workers are indexed and offered (models may differ in
        # block size); without one, every worker in the namespace.
        self.feed = feed or KvRouterFeed(bus, router, recovery_timeout=recovery_timeout, model=model or None)
        self.routed = 0

    def endpoints(self) -> list[Endpoint]:
        s = self.bus.subjects
        return [
            Endpoint("route", s.router("route"), self.route, RouteRequest),
            Endpoint("finish", s.router("finish"), self.finish, FinishRequest),
            Endpoint("index_stats", s.router("index.stats"), self.index_stats, None, bounded=False),
            Endpoint("index_dump", s.router("index.dump"), self.index_dump, DumpRequest, bounded=False),
        ]

    def metadata(self) -> dict[str, str]:
        md = super().metadata()
        md["block_size"] = str(self.router.config.block_size)
        md["mode"] = self.router.mode
        return md

    def statistics(self) -> dict[str, Any]:
        return {"routed": self.routed, "index_blocks": len(self.router.index), "feed": self.feed.stats()}

    async def on_start(self) -> None:
        if self._own_feed:
            await self.feed.start()

    async def on_stop(self) -> None:
        if self._own_feed:
            await self.feed.stop()

    # --- endpoints -----------------------------------------------------------------------------------
    def _workers(self, req: RouteRequest) -> list[Worker]:
        if req.workers is None:
            workers = self.feed.known_workers(req.role)
            if not workers:
                raise Overloaded("no live worker in the registry" + (f" with role {req.role!r}"
                                                                      if req.role else ""))
            return workers
        known = self.feed.known_workers()
        out: list[Worker] = []
        for w in req.workers:
            if isinstance(w, tuple | list):
                out.append((str(w[0]), int(w[1])))
            elif "/" in w:
                inst, _, rank = w.partition("/")
                if not rank.isdigit():
                    raise BadRequest(f"bad worker {w!r}: use 'instance' or 'instance/dp_rank'")
                out.append((inst, int(rank)))
            else:
                ranks = [k for k in known if k[0] == w]
                out.extend(ranks or [(w, 0)])
        if not out:
            raise BadRequest("workers is empty")
        return out

    async def route(self, req: RouteRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        workers = self._workers(req)
        rid = req.request_id or f"svc-{secrets.token_hex(6)}"
        decision = self.router.route(req.token_ids, workers, request_id=rid, lora_name=req.lora_name,
                                     salt=req.salt, block_sizes=self.feed.block_sizes())
        if not req.book:
            self.router.finish(rid)
        self.routed += 1
        out = decision.to_dict()
        out["request_id"] = rid
        out["booked"] = req.book
        return out

    async def finish(self, req: FinishRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        self.router.finish(req.request_id)
        return {"request_id": req.request_id, "finished": True}

    async def index_stats(self, req: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        return {**self.router.stats(), "feed": self.feed.stats(), "known_workers":
                [f"{i}/{r}" for i, r in self.feed.known_workers()]}

    async def index_dump(self, req: DumpRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        index = self.router.index
        if not isinstance(index, KvIndex):
            raise BadRequest(f"index.dump needs the exact (kv) index; this router runs {self.router.mode!r}")
        workers: dict[str, Any] = {}
        for w in sorted(index.workers()):
            if req.instance is not None and w[0] != req.instance:
                continue
            hashes = sorted(index.worker_hashes(w))
            if req.limit is not None:
                hashes = hashes[: max(0, req.limit)]
            workers[f"{w[0]}/{w[1]}"] = {"instance": w[0], "dp_rank": w[1],
                                         "block_size": index.worker_block_size(w),
                                         "last_event_id": index.last_event_id(w),
                                         "num_blocks": index.worker_blocks(w), "blocks": hashes}
        return {"block_size": self.router.config.block_size, "blocks": len(index), "workers": workers}
