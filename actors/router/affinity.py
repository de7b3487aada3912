"""Soft session affinity: a client's session id keeps the session on the worker it last used.

The client names its session with the ``x-dynamo-session-id`` header (Dynamo's name for it, so agent
harnesses that already send it work unchanged). The first request of a session is routed as any
other; later ones go to the bound worker *while it is not overloaded*: its predicted cost is at most
``OVERLOAD_FACTOR`` times the cheapest worker's (plus ``OVERLOAD_MS``, so that near-idle workers do
not count as overloaded over a few milliseconds), and it is not excluded as busy. An overloaded
bound worker is passed over for this request and the session re-binds to the worker it got.

Bindings are forgotten after ``ttl`` seconds without a request (dropped when looked up, or by the
next bind, which clears expired ones from the oldest end), and the oldest go first beyond
``max_sessions``: a client sending a new id per request cannot grow the table without bound.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

Worker = tuple[str, int]

OVERLOAD_FACTOR = 2.0
OVERLOAD_MS = 50.0
MAX_SESSIONS = 100_000


class SessionAffinity:
    def __init__(self, ttl: float, *, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_sessions = max_sessions
        self._clock = clock
        self._bound: OrderedDict[str, tuple[Worker, float]] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._bound)

    def bound(self, session: str) -> Worker | None:
        """The session's worker, if it has a binding used within ``ttl``."""
        item = self._bound.get(session)
        if item is None:
            return None
        if self._clock() - item[1] > self.ttl:
            del self._bound[session]
            return None
        return item[0]

    def bind(self, session: str, worker: Worker) -> None:
        now = self._clock()
        self._bound[session] = (worker, now)
        self._bound.move_to_end(session)
        # oldest use first: expired bindings are at the front (amortised O(1) per bind)
        cutoff = now - self.ttl
        while self._bound:
            _, used = next(iter(self._bound.values()))
            if used >= cutoff and len(self._bound) <= self.max_sessions:
                break
            self._bound.popitem(last=False)

    def remove_worker(self, instance: str) -> None:
        for s in [s for s, (w, _) in self._bound.items() if w[0] == instance]:
            del self._bound[s]

    @staticmethod
    def overloaded(bound_cost: float, best_cost: float) -> bool:
        return bound_cost > OVERLOAD_FACTOR * best_cost + OVERLOAD_MS
