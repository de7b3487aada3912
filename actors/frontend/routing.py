"""Which worker serves a request: one interface, several policies.

``choose(pool, request_tokens, exclude)`` picks one ``Worker`` from the live candidates (never an
excluded one: migration excludes the instance that just failed). ``mm`` gives the prompt's images
(``actors.kv.hashing.MmSpan``: content hash and placeholder range in ``request_tokens``) to the
policies that hash blocks (kv); the others ignore it. ``target`` pins an instance
(the ``x-worker-instance-id`` header); the ``direct`` policy requires it. ``session`` is the
client's session id (``x-dynamo-session-id``), which only the kv policy uses. The ``kv`` policy is
supplied by ``actors.router`` (KV-cache-aware cost) through ``make_router(kv_factory=...)``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from actors.kv.hashing import MmSpan
from actors.router.cost import RoutingDecision
from bus.errors import BadRequest, NotFound, Overloaded

from .discovery import Worker


class Router(Protocol):
    """Routing policy. The lifecycle hooks let a load-aware policy (kv) book and release the load it
    predicted: ``choose`` books ``request_id`` on the chosen worker, ``tokens`` reports output progress,
    ``finished`` releases it (also after a failure or migration)."""

    name: str
    # the decision behind the last ``choose``, when the policy weighs workers (kv): read right after
    # it (the event loop runs one choose at a time) by the route span (actors.frontend.flow_trace)
    last_decision: RoutingDecision | None

    def choose(self, pool: Sequence[Worker], request_tokens: Sequence[int] | None,
               exclude: set[str], *, target: str | None = None, lora: str | None = None,
               request_id: str | None = None, mm: Sequence[MmSpan] | None = None,
               session: str | None = None) -> Worker:
        """Return a worker or raise Overloaded (none left) / NotFound (unknown target)."""
        ...

    def tokens(self, request_id: str, n: int, first: bool) -> None: ...

    def finished(self, request_id: str) -> None: ...


class _Stateless:
    """No-op lifecycle hooks for policies that keep no per-request state."""

    last_decision: RoutingDecision | None = None

    def tokens(self, request_id: str, n: int, first: bool) -> None:
        pass

    def finished(self, request_id: str) -> None:
        pass


def _candidates(pool: Sequence[Worker], exclude: set[str], target: str | None) -> list[Worker]:
    if target is not None:
        for w in pool:
            if w.instance == target:
                if target in exclude:
                    raise Overloaded(f"worker {target} failed for this request")
                return [w]
        raise NotFound(f"worker instance {target!r} is not serving this model")
    cands = [w for w in pool if w.instance not in exclude] if exclude else list(pool)
    if not cands:
        raise Overloaded("no worker available for this model")
    return cands


class RoundRobinRouter(_Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, pool: Sequence[Worker], request_tokens: Sequence[int] | None,
               exclude: set[str], *, target: str | None = None, lora: str | None = None,
               request_id: str | None = None, mm: Sequence[MmSpan] | None = None,
               session: str | None = None) -> Worker:
        cands = _candidates(pool, exclude, target)
        return cands[next(self._counter) % len(cands)]


class RandomRouter(_Stateless):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, pool: Sequence[Worker], request_tokens: Sequence[int] | None,
               exclude: set[str], *, target: str | None = None, lora: str | None = None,
               request_id: str | None = None, mm: Sequence[MmSpan] | None = None,
               session: str | None = None) -> Worker:
        cands = _candidates(pool, exclude, target)
        return cands[self._rng.randrange(len(cands))]


class DirectRouter(_Stateless):
    """The client names the instance (header ``x-worker-instance-id``); no header → 400."""

    name = "direct"

    def choose(self, pool: Sequence[Worker], request_tokens: Sequence[int] | None,
               exclude: set[str], *, target: str | None = None, lora: str | None = None,
               request_id: str | None = None, mm: Sequence[MmSpan] | None = None,
               session: str | None = None) -> Worker:
        if target is None:
            raise BadRequest("router mode 'direct' needs the x-worker-instance-id header")
        return _candidates(pool, exclude, target)[0]


def make_router(kind: str, *, kv_factory: Callable[[], Router] | None = None) -> Router:
    if kind == "round_robin":
        return RoundRobinRouter()
    if kind == "random":
        return RandomRouter()
    if kind == "direct":
        return DirectRouter()
    if kind == "kv":
        if kv_factory is None:
            raise ValueError("router 'kv' needs a kv_factory (actors.router)")
        return kv_factory()
    raise ValueError(f"unknown router {kind!r}")
