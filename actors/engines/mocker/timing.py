"""The mocker's timing model: Dynamo's polynomial defaults, scaled by a speedup ratio.

- Prefill, T = new (uncached) prompt tokens computed in the step, summed over the batch:
  ``prefill_ms(T) = 4.209989e-7·T² + 1.518344e-2·T + 16.50142`` (0 when T = 0).
- Decode, p = KV blocks the step's batch held (requests finishing in it included) / total KV
  blocks (KV load, clamped to 0..1):
  ``decode_ms(p) = max(1, -25.74·p² + 54.01·p + 5.74)`` (Dynamo's ``polynomial_decode_time``),
  i.e. ~5.7 ms on an empty cache rising to ~34 ms when the cache is full.
- A step that has both prefill chunks and decodes costs the sum of the two.
- Everything is divided by ``speedup_ratio``; a ratio of 0 or infinity means *no compute at all*:
  the engine loop then never sleeps, it only yields to the event loop.
"""

from __future__ import annotations

import math


def prefill_ms(new_tokens: int) -> float:
    if new_tokens <= 0:
        return 0.0
    t = float(new_tokens)
    return 4.209989e-07 * t * t + 1.518344e-02 * t + 1.650142e01


def decode_ms(active_blocks: int, total_blocks: int) -> float:
    p = min(1.0, active_blocks / total_blocks) if total_blocks > 0 else 1.0
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


def parse_speedup(value: float | int | str) -> float:
    """Normalise ``speedup_ratio``: returns ``math.inf`` for "no compute" (0, "inf", inf)."""
    if isinstance(value, str):
        if value.strip().lower() in ("inf", "infinity", "none", "zero", "0"):
            return math.inf
        value = float(value)
    value = float(value)
    if value < 0 or math.isnan(value):
        raise ValueError(f"speedup_ratio must be >= 0, got {value}")
    return math.inf if value == 0 else value


class TimingModel:
    def __init__(self, speedup_ratio: float | int | str = 1.0) -> None:
        self.speedup = parse_speedup(speedup_ratio)

    @property
    def zero_compute(self) -> bool:
        return math.isinf(self.speedup)

    def step_seconds(self, prefill_tokens: int, num_decode: int, active_blocks: int,
                     total_blocks: int) -> float:
        """Wall time of one scheduler step in seconds (0.0 at zero compute)."""
        if self.zero_compute:
            return 0.0
        ms = prefill_ms(prefill_tokens)
        if num_decode > 0:
            ms += decode_ms(active_blocks, total_blocks)
        return ms / self.speedup / 1000.0
