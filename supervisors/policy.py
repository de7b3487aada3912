"""A supervisor's restart policy: which children restart together (the strategy), how many restarts
it forgives (intensity within period) and how long a crashed child waits first (backoff).

Pure bookkeeping, no I/O: the supervisor asks, then acts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from bus.backoff import Backoff
from supervisors.slot import Slot

Strategy = Literal["one_for_one", "one_for_all", "rest_for_one"]
STRATEGIES = ("one_for_one", "one_for_all", "rest_for_one")


@dataclass
class RestartPolicy:
    strategy: Strategy
    intensity: int
    period: float
    backoff: Backoff
    # monotonic times of the restarts still inside the period window
    _restart_times: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")

    def exceeded(self, now: float) -> bool:
        """Count a restart at ``now``; True when that makes more than ``intensity`` in ``period``."""
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > self.period:
            self._restart_times.popleft()
        return len(self._restart_times) > self.intensity

    def next_delay(self, slot: Slot, now: float) -> float:
        """Backoff before ``slot`` starts again; its attempt count resets once it had stayed up
        ``reset_seconds`` (a child that crashes after a long healthy run restarts quickly)."""
        if slot.started_mono is not None and now - slot.started_mono >= self.backoff.reset_seconds:
            slot.attempt = 0
        delay = self.backoff.delay(slot.attempt)
        slot.attempt += 1
        return delay

    def group(self, slots: list[Slot], slot: Slot) -> list[Slot]:
        """Children restarted together with ``slot``, in start order (stopped ones stay stopped)."""
        if self.strategy == "one_for_one":
            return [slot]
        live = [s for s in slots if s is slot or s.state != "stopped"]
        if self.strategy == "one_for_all":
            return live
        return live[live.index(slot):]
