"""Pure arithmetic of the scale benchmark: Prometheus histograms (parse, delta over a window,
quantiles from buckets), percentiles of samples, and how a quantity grows with N.

Kept apart from bench/scale.py (which runs deployments) so it is tested without one."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)', re.M)
_LE = re.compile(r'le="([^"]+)"')


@dataclass(frozen=True)
class Histogram:
    """One unlabelled Prometheus histogram: cumulative counts per upper bound (ascending, ``+Inf``
    last), the sum of observations and their count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def minus(self, before: Histogram) -> Histogram:
        """The observations made between ``before`` and this scrape (counters only grow)."""
        if [le for le, _ in before.buckets] != [le for le, _ in self.buckets]:
            raise ValueError("histograms with different buckets")
        return Histogram(tuple((le, c - b) for (le, c), (_, b) in zip(self.buckets, before.buckets, strict=True)),
                         self.sum - before.sum, self.count - before.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile``: find the bucket holding rank ``q * count`` and
        interpolate linearly inside it (from 0 for the first bucket). A rank in the ``+Inf`` bucket
        returns the largest finite bound: the true value is above it, by an unknown amount."""
        if not self.count:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower
                inside = cum - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cum
        return lower


def parse_histograms(text: str) -> dict[str, Histogram]:
    """Every unlabelled histogram (apart from ``le``) in a Prometheus text exposition, by name."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for m in _SAMPLE.finditer(text):
        name, labels, value = m.group("name"), m.group("labels") or "", float(m.group("value"))
        if name.endswith("_bucket"):
            le = _LE.search(labels)
            if le and labels.replace(le.group(0), "").strip(", ") == "":
                buckets.setdefault(name[:-7], []).append((float(le.group(1)), value))
        elif name.endswith("_sum") and not labels:
            sums[name[:-4]] = value
        elif name.endswith("_count") and not labels:
            counts[name[:-6]] = value
    return {n: Histogram(tuple(sorted(b)), sums.get(n, 0.0), counts.get(n, 0.0))
            for n, b in buckets.items() if n in counts}


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (the smallest sample with at least ``q`` of the samples at or below it)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass(frozen=True)
class Growth:
    """y ≈ c·N^exponent fitted by least squares on log y against log N; ``ratio`` = y(N_max)/y(N_min)
    against ``n_ratio`` = N_max/N_min."""

    exponent: float
    ratio: float
    n_ratio: float

    @property
    def shape(self) -> str:
        """A word for the exponent: flat (< 0.2), sublinear, linear (0.8-1.2), superlinear."""
        b = self.exponent
        if abs(b) < 0.2:
            return "flat"
        if b < 0:
            return "falls"
        if b < 0.8:
            return "sublinear"
        if b <= 1.2:
            return "linear"
        return "superlinear"


def growth(ns: list[int], ys: list[float | None]) -> Growth | None:
    """The power-law fit of ``ys`` over ``ns``; None with fewer than two sizes with a positive value."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys, strict=True) if y is not None and y > 0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    (x0, y0), (x1, y1) = min(pts), max(pts)
    return Growth(exponent=b, ratio=math.exp(y1 - y0), n_ratio=math.exp(x1 - x0))
