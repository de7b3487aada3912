"""Load mode: step-time lines fitted on per-step samples, per-engine latency simulation, +1/-1/0."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.engines.protocol import StepSample
from actors.planner.load_model import EngineLoad, StepRegression, decide, fit_line, simulate

# the "engine" below: a prefill step costs 5 ms + 0.02 ms per prompt token (chunks of up to 8000),
# a decode step 8 ms + 0.0001 ms per KV token
A, B, C, D = 5.0, 0.02, 8.0, 0.0001


def steps(n: int, seed: int = 0, noise: float = 0.0, a: float = A, b: float = B, c: float = C,
          d: float = D) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = int(rng.integers(100, 8001)) if i < n - 1 else 8000  # the last one: a full chunk
        out.append(StepSample(prefill_tokens=tokens, decode_requests=int(rng.integers(0, 4)),
                              kv_tokens=int(rng.integers(0, 50000)),
                              elapsed_ms=a + b * tokens + rng.normal(0, noise)))
        kv = int(rng.integers(1000, 100001))
        out.append(StepSample(prefill_tokens=0, decode_requests=int(rng.integers(1, 64)), kv_tokens=kv,
                              elapsed_ms=c + d * kv + rng.normal(0, noise)))
    return out


def fitted(n: int = 20, **kw) -> StepRegression:
    reg = StepRegression()
    reg.fit(steps(n, **kw))
    return reg


def test_recovers_coefficients_from_noisy_steps():
    reg = fitted(400, seed=1, noise=0.5)
    assert reg.ready
    pre, dec = reg.prefill_line, reg.decode_line
    assert pre is not None and dec is not None
    assert pre.intercept == pytest.approx(A, abs=0.3) and pre.slope == pytest.approx(B, rel=0.02)
    assert dec.intercept == pytest.approx(C, abs=0.3) and dec.slope == pytest.approx(D, rel=0.05)
    assert (pre.n, dec.n) == (400, 400)


def test_ready_needs_enough_steps_of_each_kind_with_spread():
    reg = StepRegression(min_samples=10)
    reg.fit(steps(9))
    assert not reg.ready and not reg.prefill_ready
    assert reg.progress() == "prefill 9/10 steps (waiting), decode 9/10 steps (waiting)"
    reg.fit(steps(1, seed=5))
    assert reg.ready
    flat = StepRegression(min_samples=10)
    flat.fit([StepSample(prefill_tokens=512, decode_requests=0, kv_tokens=0, elapsed_ms=15.0 + i)
              for i in range(12)])
    assert not flat.prefill_ready and flat.progress().startswith("prefill 12/10 steps (no spread)")
    # idle steps (nothing prefilled, nothing decoded) and broken timings count for neither
    flat.fit([StepSample(0, 0, 100, 1.0), StepSample(100, 1, 100, math.nan), StepSample(100, 1, 100, -1.0)])
    assert flat.progress() == "prefill 12/10 steps (no spread), decode 0/10 steps (waiting)"


def test_window_keeps_the_newest_steps():
    reg = StepRegression(window=50)
    reg.fit(steps(50, a=50.0, b=0.1, c=80.0, d=0.001))  # an old regime
    reg.fit(steps(50, seed=2))  # pushes every old step out
    assert reg.prefill_ms(1000) == pytest.approx(A + B * 1000)
    assert reg.decode_ms(10000) == pytest.approx(C + D * 10000)


def test_predictions():
    reg = fitted()
    assert reg.chunk_tokens == 8000
    # 20000 tokens take 3 steps of at most 8000: 3 x 5 + 0.02 x 20000
    assert reg.prefill_ms(20000) == pytest.approx(415.0)
    assert reg.prefill_ms(0) == 0.0
    assert reg.decode_ms(50000) == pytest.approx(13.0)
    with pytest.raises(ValueError, match="decode fit not ready"):
        StepRegression().decode_ms(10)


def test_a_negative_slope_is_flattened():
    line = fit_line([1, 2, 3, 4], [10.0, 9.0, 8.0, 7.0])
    assert (line.slope, line.intercept) == (0.0, 8.5)


def test_simulate():
    reg = fitted()
    e = EngineLoad("w1", num_waiting=3, num_running=10, kv_tokens=40000, queued_prefill_tokens=6000)
    ttft, itl = simulate(e, reg, isl=2000)
    assert ttft == pytest.approx(A + B * 8000)  # the queue and this request: one full chunk
    assert itl == pytest.approx(C + D * 42000)  # the engine's KV plus this request's
    _, agg_itl = simulate(e, reg, isl=2000, interference=True)
    assert agg_itl == pytest.approx(C + D * 42000 + B * 6000)  # one chunk of the queue per step
    assert simulate(e, StepRegression(), 2000) == (None, None)


def engine(name: str, queued: int = 0, kv: int = 0) -> EngineLoad:
    return EngineLoad(name, num_waiting=0, num_running=0, kv_tokens=kv, queued_prefill_tokens=queued)


def test_decide_prefill():
    reg = fitted()
    # TTFT = 5 + 0.02 x (queued + 1000): 25 ms idle, 225 with 10000 queued (two chunks: 230)
    busy = [engine("a", queued=10000), engine("b", queued=12000)]
    n, why = decide("prefill", busy, reg, 1000, 200, 50, 0.7)
    assert n == 1
    assert why == "prefill, ISL 1000: TTFT est 230.0, 270.0 ms vs target 200: every engine over target: +1"
    assert decide("prefill", busy + [engine("c")], reg, 1000, 200, 50, 0.7)[0] == 0
    # one engine fewer doubles each queue: 25 and 85 ms (2000 -> 4000 queued) stay under 140
    idle = [engine("a"), engine("b", queued=2000)]
    n, why = decide("prefill", idle, reg, 1000, 200, 50, 0.7)
    assert n == -1 and why.endswith("and with 1 engines still (TTFT est 25.0, 105.0 ms; busy up to 0%): -1"), why
    assert decide("prefill", idle, reg, 1000, 200, 50, 0.5)[0] == 0  # 105 is not under 100
    # under target as they are, but not with one fewer: 125 ms -> 225 ms with 10000 queued
    n, why = decide("prefill", [engine("a"), engine("b", queued=5000)], reg, 1000, 200, 50, 0.7)
    assert n == 0 and "but with 1 engines" in why
    # idle queues, but each engine busy 50%: one fewer would be 100% busy (a pool that keeps up
    # only because it has two replicas)
    busy_pair = [EngineLoad("a", 0, 1, 0, 0, busy=0.5), EngineLoad("b", 0, 1, 0, 0, busy=0.5)]
    n, why = decide("prefill", busy_pair, reg, 1000, 200, 50, 0.7)
    assert n == 0 and "busy up to 100%" in why


def test_decide_decode():
    reg = fitted()
    # ITL = 8 + 0.0001 x (kv + 1000)
    assert decide("decode", [engine("a", kv=99000), engine("b", kv=149000)], reg, 1000, 500, 17.0, 0.7)[0] == 1
    assert decide("decode", [engine("a", kv=9000)], reg, 1000, 500, 17.0, 0.7)[0] == -1  # 9 < 11.9
    n, why = decide("decode", [engine("a", kv=39000)], reg, 1000, 500, 17.0, 0.7)  # 12 ms
    assert n == 0 and why == "decode, ISL 1000: ITL est 12.0 ms vs target 17: hold"


def test_decide_agg_needs_both():
    reg = fitted()
    # TTFT 25 ms (idle) but ITL over target: over on either is over
    assert decide("agg", [engine("a", kv=99000)], reg, 1000, 200, 17.0, 0.7)[0] == 1
    # TTFT under x 0.7 but ITL not: hold (scaling down needs both)
    assert decide("agg", [engine("a", kv=49000)], reg, 1000, 200, 17.0, 0.7)[0] == 0
    n, why = decide("agg", [engine("a", kv=9000)], reg, 1000, 200, 17.0, 0.7)
    assert n == -1 and "TTFT est 25.0 ms vs target 200; ITL est 9.0 ms vs target 17" in why


def test_decide_without_engines_or_fits():
    assert decide("decode", [], fitted(), 1000, 200, 17, 0.7) == (0, "decode: no engines reporting load")
    reg = StepRegression()
    reg.fit([s for s in steps(20) if s.prefill_tokens == 0])  # decode steps only: a decode pool
    assert decide("decode", [engine("a")], reg, 1000, 200, 17, 0.7)[0] == -1
    n, why = decide("prefill", [engine("a")], reg, 1000, 200, 17, 0.7)
    assert n == 0 and why.startswith("prefill: step fit not ready (prefill 0/10 steps (waiting)")


def test_many_engines_are_summarized():
    reg = fitted()
    n, why = decide("prefill", [engine(f"e{i}", queued=20000) for i in range(12)], reg, 1000, 200, 50, 0.7)
    assert n == 1 and "... (12 engines)" in why
