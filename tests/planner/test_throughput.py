"""Throughput mode's replica arithmetic on a profile whose rates are known by hand."""

from __future__ import annotations

import math

import pytest

from actors.planner.contract import DecodePoint, PrefillPoint, Profile
from actors.planner.perf_model import PerfModel
from actors.planner.throughput import Demand, desired_replicas

# prefill: 12000 prompt tok/s at TTFT 300 ms for 1000-token prompts (c2), 10000 at c1
# decode: 1000 generated tok/s at ITL 32 ms (c32), 800 at 20 ms (c16), at every context
MODEL = PerfModel(Profile(
    pool="p", role="agg", engine="mocker", model="tiny", made_by="test", made_at=0.0,
    kv_capacity_tokens=10**7, max_num_seqs=256,
    prefill=[PrefillPoint(isl=1000, concurrency=1, ttft_ms=100, tokens_per_s=10000),
             PrefillPoint(isl=1000, concurrency=2, ttft_ms=300, tokens_per_s=12000),
             PrefillPoint(isl=2000, concurrency=1, ttft_ms=200, tokens_per_s=10000),
             PrefillPoint(isl=2000, concurrency=2, ttft_ms=600, tokens_per_s=12000)],
    decode=[DecodePoint(context=c, concurrency=n, itl_ms=t, tokens_per_s=r)
            for c in (1000, 3000) for n, t, r in ((16, 20, 800), (32, 32, 1000))]))


def test_prefill_uses_the_uncached_isl():
    # 10 req/s x 2000 x (1 - 0.5) = 10000 tok/s; at ISL 1000 one engine does 12000 within 300 ms
    n, why = desired_replicas("prefill", Demand(10, 2000, 200, 0.5), MODEL, 300, 32)
    assert n == 1
    assert "10000 prompt tok/s" in why and "12000 tok/s per engine" in why and "0.83 engines" in why
    assert desired_replicas("prefill", Demand(30, 2000, 200, 0.5), MODEL, 300, 32)[0] == 3  # 2.5
    # no cache: 10 x 2000 = 20000 tok/s at ISL 2000, where 300 ms allows c1.25: 10500 tok/s -> 1.9
    assert desired_replicas("prefill", Demand(10, 2000, 200, 0.0), MODEL, 300, 32)[0] == 2


def test_decode_at_context_isl_plus_half_osl():
    # 10 req/s x 200 = 2000 gen tok/s at context 1900 + 100; 1000 per engine at 32 ms -> exactly 2
    n, why = desired_replicas("decode", Demand(10, 1900, 200, 0.9), MODEL, 300, 32)
    assert n == 2
    assert "at context 2000" in why and "2.00 engines" in why
    assert desired_replicas("decode", Demand(10, 1900, 200, 0.9), MODEL, 300, 20)[0] == 3  # 800: 2.5


def test_agg_adds_prefill_and_decode_engine_time():
    # per request: 1000/12000 s prefill + 200/1000 s decode = 283.3 ms; x 5 req/s = 1.42 engines
    n, why = desired_replicas("agg", Demand(5, 2000, 200, 0.5), MODEL, 300, 32)
    assert n == 2
    assert "283.3 engine-ms per request" in why and "1.42 engines" in why
    # 3.5 req/s -> 0.99 engines
    assert desired_replicas("agg", Demand(3.5, 2000, 200, 0.5), MODEL, 300, 32)[0] == 1


def test_no_demand_is_zero():
    for role in ("agg", "prefill", "decode"):
        n, why = desired_replicas(role, Demand(0, 2000, 200, 0.0), MODEL, 300, 32)  # type: ignore[arg-type]
        assert (n, why) == (0, "no demand (0.00 req/s)")
    assert desired_replicas("decode", Demand(-4, 100, 10, 0), MODEL, 300, 32)[0] == 0
    assert desired_replicas("decode", Demand(5, 100, 0, 0), MODEL, 300, 32)[0] == 0
    # everything cached: no prefill work at all
    assert desired_replicas("prefill", Demand(50, 2000, 10, 1.5), MODEL, 300, 32)[0] == 0


def test_unreachable_targets_are_said():
    n, why = desired_replicas("prefill", Demand(10, 1000, 10, 0), MODEL, 50, 32)
    assert n == 1  # 10000 tok/s at c1, which misses 50 ms anyway
    assert "TTFT target 50 ms unreachable even at the lowest concurrency" in why


def test_bad_input():
    with pytest.raises(ValueError, match="request_rate is nan"):
        desired_replicas("agg", Demand(math.nan, 1, 1, 0), MODEL, 300, 32)
    with pytest.raises(ValueError, match="unknown pool role 'mixed'"):
        desired_replicas("mixed", Demand(1, 1, 1, 0), MODEL, 300, 32)  # type: ignore[arg-type]
