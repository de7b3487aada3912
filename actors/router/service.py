"""The KV router's NATS endpoints, served by the frontend over its own in-process router.

There is one KV router per process: the frontend's (``actors.frontend.kv_routing.KvPolicy``). These
handlers expose it on the bus, so the CLI, a planner or another frontend sees exactly what the
frontend routes with (a second router beside it would guess its block size and build a second
index). :class:`RouterEndpoints` is transport-free glue over a *provider*: a callable returning the
current ``(KvRouter, KvRouterFeed)``, or None while no worker has registered a KV block size.
``FrontendActor.endpoints()`` adds them when the frontend routes by ``kv``.

Endpoints (JSON without headers works, as ``nats req`` sends it; msgpack by Content-Type):

* ``Subjects.router("route")`` — :class:`RouteRequest` → the decision
  ``{instance, dp_rank, overlap_blocks, cost, request_blocks, costs, excluded_busy, mode}``.
  ``workers`` defaults to every live worker in the registry (of ``role`` when given). The request's
  load and predicted blocks are *not* booked unless ``book`` is true (a CLI or planner query must
  not leave phantom load behind); a booked request is released with ``finish`` (its ``request_id``).
  An image prompt routes by its images too: ``mm`` lists ``[image id, offset, length]`` per image,
  its placeholder range in ``token_ids`` (the expanded prompt; the id is what the engine was given
  as the image's uuid: the frontend sends the image's sha256).
* ``Subjects.router("finish")`` — ``{request_id}``: release a booked request's load.
* ``Subjects.router("index.stats")`` — index, predicted blocks, load and feed counters
  (``ready: false`` and empty views while the router does not exist yet).
* ``Subjects.router("index.dump")`` — ``{instance?, limit?}`` → blocks per worker (hashes).

Before a worker has registered, route, finish and index.dump answer a typed 503.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from actors.base import Endpoint
from actors.kv.hashing import MmSpan
from actors.router.feed import KvRouterFeed
from actors.router.index import KvIndex
from actors.router.kv_router import KvRouter
from bus.errors import BadRequest, Overloaded
from bus.subjects import Subjects

log = logging.getLogger(__name__)

Worker = tuple[str, int]
RouterState = tuple[KvRouter, KvRouterFeed]
NOT_READY = "router not ready: no worker has registered a KV block size yet"


class RouteRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    token_ids: list[int]
    # "instance" (rank 0 .. dp_size-1 from the registry), "instance/rank", or [instance, rank]
    workers: list[str | tuple[str, int]] | None = None
    role: str | None = None
    lora_name: str | None = None
    salt: str | None = None
    request_id: str | None = None
    book: bool = False
    mm: list[MmSpan] | None = None  # [image id, offset, length] per image


class FinishRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str


class DumpRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    instance: str | None = None
    limit: int | None = None  # at most this many hashes per worker


class RouterEndpoints:
    """``ns.router.*`` handlers over whatever router ``provider`` returns now."""

    def __init__(self, provider: Callable[[], RouterState | None]) -> None:
        self.provider = provider
        self.routed = 0

    def endpoints(self, subjects: Subjects) -> list[Endpoint]:
        s = subjects
        return [
            # strict: route may book load, finish releases it (empty payloads are a 400)
            Endpoint("route", s.router("route"), self.route, RouteRequest, allow_empty=False),
            Endpoint("finish", s.router("finish"), self.finish, FinishRequest, allow_empty=False),
            Endpoint("index_stats", s.router("index.stats"), self.index_stats, None, bounded=False),
            Endpoint("index_dump", s.router("index.dump"), self.index_dump, DumpRequest, bounded=False),
        ]

    def _state(self) -> RouterState:
        state = self.provider()
        if state is None:
            raise Overloaded(NOT_READY)
        return state

    # --- endpoints -----------------------------------------------------------------------------------
    @staticmethod
    def _workers(feed: KvRouterFeed, req: RouteRequest) -> list[Worker]:
        if req.workers is None:
            workers = feed.known_workers(req.role)
            if not workers:
                raise Overloaded("no live worker in the registry" + (f" with role {req.role!r}"
                                                                      if req.role else ""))
            return workers
        known = feed.known_workers()
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
        router, feed = self._state()
        workers = self._workers(feed, req)
        rid = req.request_id or f"svc-{secrets.token_hex(6)}"
        decision = router.route(req.token_ids, workers, request_id=rid, lora_name=req.lora_name,
                                salt=req.salt, block_sizes=feed.block_sizes(), book=req.book,
                                mm=_spans(req.mm, len(req.token_ids)))
        self.routed += 1
        out = decision.to_dict()
        out["request_id"] = rid
        out["booked"] = req.book
        return out

    async def finish(self, req: FinishRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        router, _ = self._state()
        router.finish(req.request_id)
        return {"request_id": req.request_id, "finished": True}

    async def index_stats(self, req: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        state = self.provider()
        if state is None:
            return {"ready": False, "reason": NOT_READY, "mode": None, "block_size": None,
                    "index": {"blocks": 0, "workers": {}}, "load": {}, "feed": {}, "known_workers": []}
        router, feed = state
        return {"ready": True, **router.stats(), "feed": feed.stats(), "known_workers":
                [f"{i}/{r}" for i, r in feed.known_workers()]}

    async def index_dump(self, req: DumpRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        router, _ = self._state()
        index = router.index
        if not isinstance(index, KvIndex):
            raise BadRequest(f"index.dump needs the exact (kv) index; this router runs {router.mode!r}")
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
        return {"block_size": router.config.block_size, "blocks": len(index), "workers": workers}


def _spans(mm: list[MmSpan] | None, n_tokens: int) -> list[MmSpan] | None:
    """A route request's images as the router hashes them: each range inside the prompt, in order,
    not overlapping (a range the engine could not have placed would only ever miss: say so)."""
    if not mm:
        return None
    end = 0
    for i, (ident, offset, length) in enumerate(mm):
        if not ident:
            raise BadRequest(f"mm[{i}]: the image id is empty")
        if length < 1 or offset < end or offset + length > n_tokens:
            raise BadRequest(f"mm[{i}]: placeholder range [{offset}, {offset + length}) is not inside the "
                             f"prompt's {n_tokens} tokens after the previous image (ends at {end})")
        end = offset + length
    return mm
