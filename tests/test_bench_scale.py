"""The scale benchmark's arithmetic: histogram deltas and quantiles from buckets, the growth fit."""

from __future__ import annotations

import math

import pytest

from bench.scale_stats import Histogram, growth, parse_histograms, percentile

EXPOSITION = """\
# HELP vllm_actors_router_matching_seconds Time of find_matches
# TYPE vllm_actors_router_matching_seconds histogram
vllm_actors_router_matching_seconds_bucket{le="0.001"} 10.0
vllm_actors_router_matching_seconds_bucket{le="0.01"} 30.0
vllm_actors_router_matching_seconds_bucket{le="0.1"} 40.0
vllm_actors_router_matching_seconds_bucket{le="+Inf"} 40.0
vllm_actors_router_matching_seconds_count 40.0
vllm_actors_router_matching_seconds_sum 0.5
# a labelled histogram is not one of ours: left out
http_seconds_bucket{model="tiny",le="1.0"} 3.0
http_seconds_bucket{model="tiny",le="+Inf"} 3.0
http_seconds_count{model="tiny"} 3.0
http_seconds_sum{model="tiny"} 1.0
vllm_actors_router_decisions_total{mode="kv"} 40.0
"""


def test_parse_reads_unlabelled_histograms_only() -> None:
    hs = parse_histograms(EXPOSITION)
    assert set(hs) == {"vllm_actors_router_matching_seconds"}
    h = hs["vllm_actors_router_matching_seconds"]
    assert h.buckets == ((0.001, 10.0), (0.01, 30.0), (0.1, 40.0), (math.inf, 40.0))
    assert (h.count, h.sum) == (40.0, 0.5)


def test_delta_and_quantiles_interpolate_inside_the_bucket() -> None:
    after = parse_histograms(EXPOSITION)["vllm_actors_router_matching_seconds"]
    before = Histogram(((0.001, 10.0), (0.01, 10.0), (0.1, 10.0), (math.inf, 10.0)), 0.004, 10.0)
    d = after.minus(before)
    assert d.buckets == ((0.001, 0.0), (0.01, 20.0), (0.1, 30.0), (math.inf, 30.0))
    assert d.count == 30.0 and d.mean == pytest.approx(0.496 / 30)
    # rank 15 of 30 lies in (0.001, 0.01], 15 of its 20 observations in: 0.001 + 0.009 * 0.75
    assert d.quantile(0.5) == pytest.approx(0.00775)
    # rank 29.7 lies in (0.01, 0.1], 9.7 of its 10
    assert d.quantile(0.99) == pytest.approx(0.01 + 0.09 * 0.97)
    assert Histogram(((1.0, 0.0), (math.inf, 0.0)), 0.0, 0.0).quantile(0.5) is None


def test_a_rank_beyond_the_last_bound_reports_that_bound() -> None:
    h = Histogram(((0.001, 1.0), (0.1, 2.0), (math.inf, 10.0)), 5.0, 10.0)
    assert h.quantile(0.99) == 0.1


def test_delta_of_different_buckets_is_refused() -> None:
    a = Histogram(((1.0, 1.0), (math.inf, 1.0)), 1.0, 1.0)
    b = Histogram(((2.0, 1.0), (math.inf, 1.0)), 1.0, 1.0)
    with pytest.raises(ValueError):
        a.minus(b)


def test_percentile_is_nearest_rank() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 0.5) == 50.0
    assert percentile(xs, 0.99) == 99.0
    assert percentile([], 0.5) is None


@pytest.mark.parametrize(("ys", "exponent", "shape"), [
    ([10.0, 20.0, 40.0, 80.0], 1.0, "linear"),
    ([5.0, 5.0, 5.0, 5.0], 0.0, "flat"),
    ([1.0, 4.0, 16.0, 64.0], 2.0, "superlinear"),
    ([100.0, 50.0, 25.0, 12.5], -1.0, "falls"),
    ([3.0, 3.0 * 2 ** 0.5, 6.0, 6.0 * 2 ** 0.5], 0.5, "sublinear"),
])
def test_growth_fits_the_power_of_n(ys: list[float], exponent: float, shape: str) -> None:
    g = growth([8, 16, 32, 64], ys)
    assert g is not None
    assert g.exponent == pytest.approx(exponent)
    assert g.shape == shape
    assert g.n_ratio == pytest.approx(8.0) and g.ratio == pytest.approx(ys[-1] / ys[0])


def test_growth_needs_two_sizes_with_a_positive_value() -> None:
    assert growth([8, 16], [1.0, None]) is None
    assert growth([8, 16], [0.0, 3.0]) is None
    g = growth([8, 16, 32], [None, 2.0, 4.0])
    assert g is not None and g.exponent == pytest.approx(1.0)
