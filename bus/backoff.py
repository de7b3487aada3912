"""Exponential backoff with jitter: the one delay policy of the project (a supervisor's restarts of
one child, a NATS reconnect, a loop that retries until the bus answers). Retrying one library call
(an HTTP download) uses tenacity instead.

For restarts: OTP restarts at once and relies on intensity/period alone; engines take tens of seconds to load, so a
crash loop without spacing would burn the intensity budget in a burst. Delays grow per child and
reset once the child has stayed up for ``reset_after`` seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Backoff:
    initial: float = 0.5
    max: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.2  # fraction: the delay is scaled by a factor in [1 - jitter, 1 + jitter]
    reset_after: float | None = None  # seconds up before the attempt count resets (None: max(10, max))

    def __post_init__(self) -> None:
        if self.initial < 0 or self.max < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"invalid backoff {self!r}")

    @classmethod
    def of(cls, cfg: Any | None) -> Backoff:
        """Accept a Backoff, anything with initial/max/multiplier/jitter (topology.BackoffConfig),
        a dict with those keys, or None (defaults)."""
        if cfg is None:
            return cls()
        if isinstance(cfg, Backoff):
            return cfg
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d: getattr(cfg, k, d))
        return cls(initial=float(get("initial", cls.initial)), max=float(get("max", cls.max)),
                   multiplier=float(get("multiplier", cls.multiplier)),
                   jitter=float(get("jitter", cls.jitter)), reset_after=get("reset_after", None))

    @property
    def reset_seconds(self) -> float:
        return self.reset_after if self.reset_after is not None else max(10.0, self.max)

    def base(self, attempt: int) -> float:
        """Delay before attempt ``attempt`` (0-based) without jitter."""
        if attempt <= 0:
            return min(self.initial, self.max)
        # cap the exponent so a long crash loop cannot overflow the float
        return min(self.max, self.initial * self.multiplier ** min(attempt, 64))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        d = self.base(attempt)
        if self.jitter and d > 0:
            r = (rng or random).uniform(1 - self.jitter, 1 + self.jitter)
            d = min(self.max, d * r)
        return d
