"""Suspects go to a worker one at a time, so that only a request of death meets a second death.

A request whose worker died while serving it is a suspect: it may be the request that killed the
worker (``actors.frontend.quarantine`` fails and refuses a request after its second death). When
a worker dies under many streams, all of them are suspects and all migrate at once; sent to the
same next worker, the innocent ones would be there when the guilty one kills it, see the same
second death and be quarantined with it (bystanders).

So a suspect is sent only to a worker where no other suspect is on probation, and is on probation
there until its first chunk comes back: the engine has taken it and run its prompt, which is where
a request of death kills an engine. If a worker dies while a suspect is on probation there, the
death is that suspect's: it does not count for the other suspects that worker was serving (they
passed their probation there). A fresh request's first death counts as before.

Held per frontend process: suspects of two frontend processes can still meet on one worker.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

from .discovery import Worker

# deaths remembered with the suspect on probation at the time (bystanders may judge a death after
# the suspect released its slot); a death is judged within a stall timeout, so a few suffice
_REMEMBERED = 256


class Probation:
    def __init__(self) -> None:
        # worker instance -> (its incarnation, the request on probation there)
        self._holders: dict[str, tuple[float, str]] = {}
        # (instance, incarnation) that died -> the request on probation there as it died
        self._blamed: collections.OrderedDict[tuple[str, float], str] = collections.OrderedDict()
        self._released = asyncio.Event()

    def free(self, pool: Sequence[Worker]) -> list[Worker]:
        """The workers of ``pool`` with no suspect on probation."""
        if not self._holders:
            return list(pool)
        return [w for w in pool if w.instance not in self._holders]

    def hold(self, worker: Worker, request_id: str) -> None:
        self._holders[worker.instance] = (worker.started_at, request_id)

    def release(self, worker: Worker, request_id: str, *, died: bool = False) -> None:
        """``request_id`` is off probation on ``worker`` (its first chunk came, or its attempt
        ended); ``died``: the worker died under it, so that death is its own."""
        held = self._holders.get(worker.instance)
        if held is None or held[1] != request_id:
            return
        del self._holders[worker.instance]
        if died:
            self._blamed[(worker.instance, worker.started_at)] = request_id
            while len(self._blamed) > _REMEMBERED:
                self._blamed.popitem(last=False)
        self._released.set()
        self._released = asyncio.Event()

    def on_probation(self, worker: Worker) -> str | None:
        """The suspect on probation on this incarnation of ``worker`` now, or as it died."""
        held = self._holders.get(worker.instance)
        if held is not None and held[0] == worker.started_at:
            return held[1]
        return self._blamed.get((worker.instance, worker.started_at))

    async def released(self, timeout: float) -> None:
        """Return when a slot is released, or after ``timeout`` (the pool may change meanwhile)."""
        try:
            await asyncio.wait_for(self._released.wait(), timeout)
        except TimeoutError:
            pass
