"""Load mode: step time fitted on live per-step samples, latency simulated per engine, one step.

``StepRegression`` keeps the newest ``window`` steps of each kind and fits by least squares
(``numpy.polyfit``; scikit-learn is not a dependency and a line needs none of it):

- steps that computed prompt tokens: ``elapsed_ms ~ a + b x prefill_tokens``. With chunked prefill
  (vLLM's default) such steps decode too, so ``a`` carries the typical decode work of a mixed step.
- pure decode steps: ``elapsed_ms ~ c + d x kv_tokens``.

A negative slope (noise over a narrow spread) is refitted as a flat line: step time does not fall
with more work. ``simulate`` turns the fits into one engine's latency for a new request of ``isl``
prompt tokens; ``decide`` turns every engine's into +1, -1 or 0 replicas.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actors.engines.protocol import StepSample

MIN_SAMPLES = 10  # steps of a kind before its fit is trusted
WINDOW = 2000  # newest steps of each kind kept (a few seconds at vLLM's step rates)


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float
    n: int

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        slope, intercept = 0.0, float(y.mean())
    return Line(float(intercept), float(slope), len(x))


class _Series:
    def __init__(self, window: int) -> None:
        self.x: deque[float] = deque(maxlen=window)
        self.y: deque[float] = deque(maxlen=window)
        self.line: Line | None = None

    def add(self, x: float, y: float) -> None:
        self.x.append(x)
        self.y.append(y)

    def spread(self) -> bool:
        return len(self.x) > 1 and max(self.x) > min(self.x)

    def refit(self, min_samples: int) -> None:
        self.line = fit_line(self.x, self.y) if len(self.x) >= min_samples and self.spread() else None


class StepRegression:
    """Step time as a line in prefill tokens (prefill steps) and in KV tokens (decode steps)."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self.min_samples = min_samples
        self._prefill = _Series(window)
        self._decode = _Series(window)
        # the largest prefill a step was seen to take: the engine's chunk (max_num_batched_tokens)
        self.chunk_tokens = 0

    def fit(self, samples: Sequence[StepSample]) -> None:
        """Add the newest steps (from every engine of a pool) to the windows and refit both lines."""
        for s in samples:
            if not math.isfinite(s.elapsed_ms) or s.elapsed_ms < 0:
                continue
            if s.prefill_tokens > 0:
                self._prefill.add(s.prefill_tokens, s.elapsed_ms)
                self.chunk_tokens = max(self.chunk_tokens, s.prefill_tokens)
            elif s.decode_requests > 0:
                self._decode.add(s.kv_tokens, s.elapsed_ms)
        self._prefill.refit(self.min_samples)
        self._decode.refit(self.min_samples)

    # --- readiness ---------------------------------------------------------------------------------
    @property
    def prefill_ready(self) -> bool:
        return self._prefill.line is not None

    @property
    def decode_ready(self) -> bool:
        return self._decode.line is not None

    @property
    def ready(self) -> bool:
        """Both lines fitted: ``min_samples`` steps of each kind, not all at one size."""
        return self.prefill_ready and self.decode_ready

    def progress(self) -> str:
        """How far each fit is from ready, in words (for decisions that wait)."""
        def one(name: str, s: _Series) -> str:
            state = "ready" if s.line else ("no spread" if len(s.x) >= self.min_samples else "waiting")
            return f"{name} {len(s.x)}/{self.min_samples} steps ({state})"
        return f"{one('prefill', self._prefill)}, {one('decode', self._decode)}"

    @property
    def prefill_line(self) -> Line | None:
        return self._prefill.line

    @property
    def decode_line(self) -> Line | None:
        return self._decode.line

    # --- predictions -------------------------------------------------------------------------------
    def prefill_ms(self, tokens: float) -> float:
        """Time to prefill ``tokens`` prompt tokens, in steps of at most the largest prefill seen
        (each step pays the intercept). ValueError before ``prefill_ready``."""
        line = self._prefill.line
        if line is None:
            raise ValueError(f"prefill fit not ready: {self.progress()}")
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / self.chunk_tokens) if self.chunk_tokens else 1
        return max(0.0, steps * line.intercept + line.slope * tokens)

    def decode_ms(self, kv_tokens: float) -> float:
        """One decode step (an ITL) with ``kv_tokens`` in the KV cache. ValueError before
        ``decode_ready``."""
        line = self._decode.line
        if line is None:
            raise ValueError(f"decode fit not ready: {self.progress()}")
        return max(0.0, line.at(max(0.0, kv_tokens)))


@dataclass
class EngineLoad:
    """One engine's (worker instance's) load as its newest load report has it."""

    instance: str
    num_waiting: int
    num_running: int
    kv_tokens: int  # KV tokens in use
    queued_prefill_tokens: int  # uncached prompt tokens of the waiting requests
    busy: float = 0.0  # share of the last interval the engine spent in steps (0..1 per rank)

    def sharing(self, factor: float) -> EngineLoad:
        """This engine carrying ``factor`` times its load (a removed replica's share spread)."""
        return EngineLoad(self.instance, num_waiting=self.num_waiting, num_running=self.num_running,
                          kv_tokens=round(self.kv_tokens * factor),
                          queued_prefill_tokens=round(self.queued_prefill_tokens * factor),
                          busy=self.busy * factor)


# an engine busier than this after a scale-down starts to queue: the simulated latency of its
# current queue would then be no guide to the next interval's
BUSY_CEILING = 0.85


def simulate(engine: EngineLoad, reg: StepRegression, isl: float,
             interference: bool = False) -> tuple[float | None, float | None]:
    """(TTFT ms, ITL ms) a new request of ``isl`` prompt tokens would see on ``engine``; None where
    that fit is not ready.

    TTFT: prefilling the waiting queue and then this request. ITL: a decode step with the engine's
    KV tokens plus this request's. ``interference`` (agg engines): chunked prefill puts the waiting
    queue's prefill into the decode steps, so each step while it drains also computes up to one
    chunk of it; ITL adds that chunk's marginal time (slope x min(chunk, queued tokens), not the
    intercept, which the decode step already pays).
    """
    ttft = reg.prefill_ms(engine.queued_prefill_tokens + isl) if reg.prefill_ready else None
    itl = None
    if reg.decode_ready:
        itl = reg.decode_ms(engine.kv_tokens + isl)
        line = reg.prefill_line
        if interference and line is not None:
            itl += line.slope * min(reg.chunk_tokens, engine.queued_prefill_tokens)
    return ttft, itl


def _ms(values: Sequence[float]) -> str:
    shown = ", ".join(f"{v:.1f}" for v in values[:8])
    return shown + (f", ... ({len(values)} engines)" if len(values) > 8 else "")


def decide(role: str, engines: list[EngineLoad], reg: StepRegression, isl: float, ttft_target_ms: float,
           itl_target_ms: float, sensitivity: float) -> tuple[int, str]:
    """+1 when every engine is over target (prefill: TTFT, decode: ITL, agg: either); -1 when every
    engine would stay under target x ``sensitivity`` (agg: both) and under ``BUSY_CEILING`` busy
    with one replica fewer; else 0; and why, with the estimates.

    Why the scale-down looks one replica ahead: judged on the engines as they are, a pool that
    keeps up only because it has n replicas looks idle (empty queues), loses one, queues, gains it
    back, and oscillates every interval. The remaining n-1 engines take the removed one's share:
    queue, KV and busy time grow by n/(n-1)."""
    if not engines:
        return 0, f"{role}: no engines reporting load"
    use_ttft, use_itl = role in ("prefill", "agg"), role in ("decode", "agg")
    if (use_ttft and not reg.prefill_ready) or (use_itl and not reg.decode_ready):
        return 0, f"{role}: step fit not ready ({reg.progress()})"

    def estimates(loads: list[EngineLoad]) -> tuple[list[float], list[float], list[bool], list[bool]]:
        sims = [simulate(e, reg, isl, interference=role == "agg") for e in loads]
        over = [(use_ttft and t is not None and t > ttft_target_ms) or (use_itl and i is not None and i > itl_target_ms)
                for t, i in sims]
        under = [(not use_ttft or (t is not None and t < ttft_target_ms * sensitivity))
                 and (not use_itl or (i is not None and i < itl_target_ms * sensitivity)) for t, i in sims]
        return [t for t, _ in sims if t is not None], [i for _, i in sims if i is not None], over, under

    ttfts, itls, over, under = estimates(engines)
    parts = []
    if use_ttft:
        parts.append(f"TTFT est {_ms(ttfts)} ms vs target {ttft_target_ms:g}")
    if use_itl:
        parts.append(f"ITL est {_ms(itls)} ms vs target {itl_target_ms:g}")
    seen = f"{role}, ISL {isl:.0f}: " + "; ".join(parts)
    if all(over):
        return 1, f"{seen}: every engine over target: +1"
    if not all(under):
        return 0, f"{seen}: hold"
    n = len(engines)
    if n == 1:
        return -1, f"{seen}: every engine under target x {sensitivity:g}: -1"
    fewer = [e.sharing(n / (n - 1)) for e in engines]
    ttfts2, itls2, _, under2 = estimates(fewer)
    busiest = max(e.busy for e in fewer)
    after = "; ".join(([f"TTFT est {_ms(ttfts2)} ms"] if use_ttft else [])
                      + ([f"ITL est {_ms(itls2)} ms"] if use_itl else []) + [f"busy up to {busiest:.0%}"])
    if all(under2) and busiest < BUSY_CEILING:
        return -1, f"{seen}: under target x {sensitivity:g}, and with {n - 1} engines still ({after}): -1"
    return 0, f"{seen}: under target, but with {n - 1} engines: {after}: hold"
