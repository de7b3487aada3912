"""Per-engine rates from a measured profile (``Profile``): what throughput mode divides demand by.

"Engine" here is what the profiler measured: one worker of the pool, all its tensor/pipeline/data
parallel ranks together, so demand over these rates counts replicas (the budgets then count
replicas x engines_per_replica).

A profile holds points measured at a few (ISL, concurrency) and (context, concurrency) pairs. Every
question is answered the same way: for each measured concurrency, the latency and tokens/s at the
asked ISL (or context) are interpolated linearly between the measured ISLs (``numpy.interp``); over
concurrency the model is piecewise linear between the measured levels, and the best rate is the
highest tokens/s on it whose latency meets the target (and, for decode, whose concurrency fits the KV
cache and ``max_num_seqs``). Between two levels where the target is crossed, the crossing point
counts: a mix of the two concurrencies over time.

Outside the measured range nothing is extrapolated: an ISL or context beyond the profile's answers as
its nearest measured one (``clamped`` says so), and no concurrency above the highest measured is
assumed to help. An ISL longer than the longest measured therefore under-predicts TTFT: profile the
ISLs you serve.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from actors.planner.contract import PROFILE_VERSION, Profile


class ProfileError(ValueError):
    """A profile file that is missing, unreadable, of another version, or that cannot answer."""


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file (msgspec JSON); every error names the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ProfileError(f"profile {path}: cannot read: {e.strerror or e}") from e
    try:
        profile = msgspec.json.decode(raw, type=Profile)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProfileError(f"profile {path}: not a profile: {e}") from e
    check_profile(profile, str(path))
    return profile


def check_profile(p: Profile, source: str) -> None:
    """Raise ProfileError (naming ``source``) unless ``p`` can answer its role's questions."""
    if p.version != PROFILE_VERSION:
        raise ProfileError(f"profile {source}: version {p.version}, this planner reads version "
                           f"{PROFILE_VERSION}: measure it again")
    if p.kv_capacity_tokens <= 0 or p.max_num_seqs <= 0:
        raise ProfileError(f"profile {source}: kv_capacity_tokens and max_num_seqs must be positive")
    if p.role in ("agg", "prefill") and not p.prefill:
        raise ProfileError(f"profile {source}: a {p.role} pool's profile needs prefill points")
    if p.role in ("agg", "decode") and not p.decode:
        raise ProfileError(f"profile {source}: a {p.role} pool's profile needs decode points")
    for pp in p.prefill:
        if pp.isl <= 0 or pp.concurrency <= 0 or pp.ttft_ms < 0 or not pp.tokens_per_s > 0:
            raise ProfileError(f"profile {source}: bad prefill point {pp}")
    for dp in p.decode:
        if dp.context <= 0 or dp.concurrency <= 0 or dp.itl_ms < 0 or not dp.tokens_per_s > 0:
            raise ProfileError(f"profile {source}: bad decode point {dp}")


@dataclass(frozen=True)
class RateEstimate:
    """The best per-engine rate meeting a latency target, and where on the profile it lies."""

    rate: float  # tokens/s (prefill: prompt tokens; decode: generated tokens, all requests)
    concurrency: float  # requests in flight on the engine at that rate (interpolated)
    latency_ms: float  # predicted TTFT (prefill) or ITL (decode) there
    reachable: bool  # False: even the lowest concurrency misses the target (or the KV cache)
    clamped: bool  # the ISL/context lay outside the measured range
    limit: str  # what bounded the concurrency, in words

    def describe(self, what: str) -> str:
        text = (f"{self.rate:.0f} tok/s per engine at concurrency {self.concurrency:.1f}, "
                f"{what} {self.latency_ms:.1f} ms (bound: {self.limit})")
        if self.clamped:
            text += "; outside the profile's range, clamped"
        return text


@dataclass(frozen=True)
class _Level:
    """One measured concurrency, interpolated at the asked ISL/context."""

    concurrency: float
    latency_ms: float
    rate: float


class _Surface:
    """Latency and tokens/s over (size, concurrency) from points measured at a few of each."""

    def __init__(self, points: Iterable[tuple[int, int, float, float]]) -> None:
        by_c: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
        for size, c, lat, rate in points:
            by_c[c].append((size, lat, rate))
        self._levels: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        for c in sorted(by_c):
            rows = sorted(by_c[c])
            self._levels.append((c, np.array([r[0] for r in rows], dtype=float),
                                 np.array([r[1] for r in rows]), np.array([r[2] for r in rows])))
        sizes = [r[0] for rows in by_c.values() for r in rows]
        self.size_range = (min(sizes, default=0), max(sizes, default=0))

    def __bool__(self) -> bool:
        return bool(self._levels)

    def at(self, size: float) -> list[_Level]:
        """Every measured concurrency at ``size`` (np.interp clamps outside each level's range)."""
        return [_Level(float(c), float(np.interp(size, s, lat)), float(np.interp(size, s, rate)))
                for c, s, lat, rate in self._levels]

    def clamped(self, size: float) -> bool:
        lo, hi = self.size_range
        return not lo <= size <= hi

    def latency(self, size: float, concurrency: float) -> float:
        levels = self.at(size)
        return float(np.interp(concurrency, [lv.concurrency for lv in levels],
                               [lv.latency_ms for lv in levels]))


def best_rate(levels: Sequence[_Level], target_ms: float, max_concurrency: float) -> tuple[_Level, bool]:
    """The highest rate on the piecewise-linear curve through ``levels`` (ascending concurrency)
    whose latency is <= ``target_ms`` and concurrency <= ``max_concurrency``; (lowest level, False)
    when no point qualifies."""
    def ok(lv: _Level) -> bool:
        return lv.latency_ms <= target_ms * (1 + 1e-9) and lv.concurrency <= max_concurrency * (1 + 1e-9)

    def between(a: _Level, b: _Level, c: float) -> _Level:
        f = (c - a.concurrency) / (b.concurrency - a.concurrency)
        return _Level(c, a.latency_ms + f * (b.latency_ms - a.latency_ms), a.rate + f * (b.rate - a.rate))

    candidates = [lv for lv in levels if ok(lv)]
    # latency and rate are linear on a segment, so its best feasible point is an endpoint of the
    # feasible part: a measured level (above), where latency crosses the target, or the cap
    for a, b in zip(levels, levels[1:], strict=False):
        cuts = []
        if (a.latency_ms - target_ms) * (b.latency_ms - target_ms) < 0:
            cuts.append(a.concurrency + (target_ms - a.latency_ms) / (b.latency_ms - a.latency_ms)
                        * (b.concurrency - a.concurrency))
        if a.concurrency < max_concurrency < b.concurrency:
            cuts.append(max_concurrency)
        candidates += [p for p in (between(a, b, c) for c in cuts) if ok(p)]
    if not candidates:
        return levels[0], False
    return max(candidates, key=lambda lv: (lv.rate, -lv.concurrency)), True


class PerfModel:
    """Rates and latencies of one engine of a pool, from its profile."""

    def __init__(self, profile: Profile) -> None:
        check_profile(profile, f"of pool {profile.pool}")
        self.profile = profile
        self._prefill = _Surface((p.isl, p.concurrency, p.ttft_ms, p.tokens_per_s) for p in profile.prefill)
        self._decode = _Surface((p.context, p.concurrency, p.itl_ms, p.tokens_per_s) for p in profile.decode)

    def _need(self, surface: _Surface, what: str) -> _Surface:
        if not surface:
            raise ProfileError(f"profile of pool {self.profile.pool} has no {what} points")
        return surface

    # --- rates ------------------------------------------------------------------------------------
    def prefill_estimate(self, isl: float, ttft_target_ms: float) -> RateEstimate:
        s = self._need(self._prefill, "prefill")
        isl = max(isl, 1.0)
        best, ok = best_rate(s.at(isl), ttft_target_ms, math.inf)
        limit = (f"TTFT target {ttft_target_ms:g} ms" if ok
                 else f"TTFT target {ttft_target_ms:g} ms unreachable even at the lowest concurrency")
        return RateEstimate(best.rate, best.concurrency, best.latency_ms, ok, s.clamped(isl), limit)

    def prefill_rate(self, isl: float, ttft_target_ms: float) -> float:
        """Prompt tokens/s one engine sustains with mean TTFT <= target at this ISL (the rate at
        the lowest measured concurrency when none meets it: ``prefill_estimate().reachable``)."""
        return self.prefill_estimate(isl, ttft_target_ms).rate

    def decode_estimate(self, context: float, itl_target_ms: float) -> RateEstimate:
        s = self._need(self._decode, "decode")
        context = max(context, 1.0)
        kv_cap = self.profile.kv_capacity_tokens / context
        cap = min(kv_cap, float(self.profile.max_num_seqs))
        best, ok = best_rate(s.at(context), itl_target_ms, cap)
        if not ok:
            limit = (f"context {context:.0f} does not fit the KV cache ({self.profile.kv_capacity_tokens} tokens)"
                     if kv_cap < s.at(context)[0].concurrency
                     else f"ITL target {itl_target_ms:g} ms unreachable even at the lowest concurrency")
        elif best.concurrency >= cap * (1 - 1e-9):
            limit = (f"KV capacity {self.profile.kv_capacity_tokens} tokens" if kv_cap <= self.profile.max_num_seqs
                     else f"max_num_seqs {self.profile.max_num_seqs}")
        else:
            limit = f"ITL target {itl_target_ms:g} ms"
        return RateEstimate(best.rate, best.concurrency, best.latency_ms, ok, s.clamped(context), limit)

    def decode_rate(self, context: float, itl_target_ms: float) -> float:
        """Generated tokens/s (all requests together) one engine sustains with mean ITL <= target
        at this context, with concurrency x context <= kv_capacity_tokens and <= max_num_seqs."""
        return self.decode_estimate(context, itl_target_ms).rate

    # --- predictions for reports ------------------------------------------------------------------
    def ttft_ms(self, isl: float, concurrency: float) -> float:
        """Mean TTFT the profile predicts (interpolated over ISL and concurrency, clamped)."""
        return self._need(self._prefill, "prefill").latency(isl, concurrency)

    def itl_ms(self, context: float, concurrency: float) -> float:
        """Mean ITL the profile predicts (interpolated over context and concurrency, clamped)."""
        return self._need(self._decode, "decode").latency(context, concurrency)

