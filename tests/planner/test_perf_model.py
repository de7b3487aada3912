"""Profile reading and the per-engine rates interpolated from it, on a profile whose answers are
worked out by hand below."""

from __future__ import annotations

import time

import msgspec
import pytest

from actors.planner.contract import DecodePoint, PrefillPoint, Profile
from actors.planner.perf_model import PerfModel, ProfileError, load_profile

# prefill, (isl, concurrency) -> (ttft ms, prompt tok/s)
PREFILL = {(1000, 1): (100, 10000), (1000, 2): (200, 12000), (1000, 4): (500, 14000),
           (3000, 1): (300, 9000), (3000, 2): (600, 10000), (3000, 4): (1500, 12000)}
# decode, (context, concurrency) -> (itl ms, generated tok/s = concurrency x 1000 / itl)
DECODE = {(1000, 8): (10, 800), (1000, 16): (16, 1000), (1000, 32): (20, 1600), (1000, 64): (32, 2000),
          (2000, 8): (16, 500), (2000, 16): (20, 800), (2000, 32): (32, 1000), (2000, 64): (40, 1600)}


def profile(role: str = "agg", kv: int = 40000, max_num_seqs: int = 64, **kw) -> Profile:
    fields = dict(
        pool=f"{role}-pool", role=role, engine="mocker", model="tiny", made_by="test", made_at=time.time(),
        kv_capacity_tokens=kv, max_num_seqs=max_num_seqs,
        prefill=[PrefillPoint(isl=i, concurrency=c, ttft_ms=t, tokens_per_s=r) for (i, c), (t, r) in PREFILL.items()],
        decode=[DecodePoint(context=x, concurrency=c, itl_ms=t, tokens_per_s=r) for (x, c), (t, r) in DECODE.items()])
    fields.update(kw)
    return Profile(**fields)


# --- prefill -----------------------------------------------------------------------------------------
def test_prefill_highest_concurrency_meeting_ttft():
    m = PerfModel(profile())
    assert m.prefill_rate(1000, 500) == pytest.approx(14000)  # c4 meets exactly
    assert m.prefill_rate(1000, 5000) == pytest.approx(14000)  # nothing above c4 is assumed
    est = m.prefill_estimate(1000, 500)
    assert (est.concurrency, est.latency_ms, est.reachable, est.clamped) == (4, 500, True, False)


def test_prefill_interpolates_where_the_target_is_crossed():
    m = PerfModel(profile())
    # c2 (200 ms) meets 350, c4 (500 ms) misses: crossing at c = 2 + 2 x 150/300 = 3, rate halfway
    est = m.prefill_estimate(1000, 350)
    assert est.concurrency == pytest.approx(3)
    assert est.rate == pytest.approx(13000)
    assert est.latency_ms == pytest.approx(350)


def test_prefill_interpolates_over_isl():
    m = PerfModel(profile())
    # at ISL 2000 (halfway): c1 200 ms/9500, c2 400 ms/11000, c4 1000 ms/13000
    assert m.prefill_rate(2000, 400) == pytest.approx(11000)
    assert m.prefill_rate(2000, 700) == pytest.approx(12000)  # c = 3
    assert m.ttft_ms(2000, 3) == pytest.approx(700)
    assert m.ttft_ms(2000, 1) == pytest.approx(200)


def test_prefill_unreachable_target_answers_concurrency_one_and_says_so():
    est = PerfModel(profile()).prefill_estimate(3000, 200)
    assert (est.rate, est.concurrency, est.latency_ms, est.reachable) == (9000, 1, 300, False)
    assert "unreachable" in est.limit


def test_prefill_clamps_outside_the_measured_isls():
    m = PerfModel(profile())
    long, short = m.prefill_estimate(5000, 700), m.prefill_estimate(500, 350)
    assert long.rate == m.prefill_rate(3000, 700) and long.clamped
    assert short.rate == m.prefill_rate(1000, 350) and short.clamped
    assert m.ttft_ms(9000, 99) == 1500  # both axes clamped


# --- decode ------------------------------------------------------------------------------------------
def test_decode_bounded_by_itl():
    est = PerfModel(profile()).decode_estimate(1000, 18)
    # c16 (16 ms) meets, c32 (20 ms) misses: crossing at c24, rate 1000 + 600/2
    assert est.concurrency == pytest.approx(24)
    assert est.rate == pytest.approx(1300)
    assert est.limit == "ITL target 18 ms"


def test_decode_bounded_by_kv_capacity():
    # 40000 KV tokens / 1000 context = 40 requests; ITL at 40 is 20 + 12 x 8/32 = 23 ms <= 25
    est = PerfModel(profile(kv=40000)).decode_estimate(1000, 25)
    assert est.concurrency == pytest.approx(40)
    assert est.rate == pytest.approx(1700)
    assert est.latency_ms == pytest.approx(23)
    assert est.limit == "KV capacity 40000 tokens"


def test_decode_bounded_by_max_num_seqs():
    est = PerfModel(profile(kv=10**7, max_num_seqs=48)).decode_estimate(1000, 100)
    assert est.concurrency == pytest.approx(48)
    assert est.rate == pytest.approx(1800)
    assert est.limit == "max_num_seqs 48"


def test_decode_interpolates_over_context():
    m = PerfModel(profile(kv=10**7))
    # context 1500: c16 ITL 18 ms, 900 tok/s; c32 26 ms, 1300 tok/s; crossing 22 ms at c24
    assert m.itl_ms(1500, 16) == pytest.approx(18)
    assert m.decode_rate(1500, 22) == pytest.approx(1100)


def test_decode_unreachable():
    m = PerfModel(profile())
    itl = m.decode_estimate(1000, 5)
    assert (itl.rate, itl.concurrency, itl.reachable) == (800, 8, False)
    assert "ITL target 5 ms unreachable" in itl.limit
    kv = m.decode_estimate(50000, 100)  # 0.8 requests fit
    assert not kv.reachable and kv.clamped and kv.rate == 500
    assert kv.limit == "context 50000 does not fit the KV cache (40000 tokens)"


def test_a_missing_side_is_a_profile_error():
    m = PerfModel(profile(role="decode", prefill=[]))
    with pytest.raises(ProfileError, match="no prefill points"):
        m.prefill_rate(1000, 500)
    with pytest.raises(ProfileError, match="needs prefill points"):
        PerfModel(profile(role="prefill", prefill=[]))


def test_a_single_point_profile_answers_everywhere():
    m = PerfModel(profile(prefill=[PrefillPoint(isl=512, concurrency=1, ttft_ms=50, tokens_per_s=8000)]))
    assert m.prefill_rate(4096, 500) == 8000
    assert m.ttft_ms(100, 8) == 50


# --- files -------------------------------------------------------------------------------------------
def test_load_profile_round_trip(tmp_path):
    p = profile()
    path = tmp_path / "agg.json"
    path.write_bytes(msgspec.json.encode(p))
    assert load_profile(path) == p
    assert load_profile(str(path)) == p


def test_load_profile_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match=f"profile {missing}: cannot read"):
        load_profile(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=f"profile {bad}: not a profile"):
        load_profile(bad)
    typed = tmp_path / "typed.json"
    typed.write_text('{"pool": "p"}')
    with pytest.raises(ProfileError, match="not a profile: Object missing required field"):
        load_profile(typed)
    old = tmp_path / "old.json"
    old.write_bytes(msgspec.json.encode(profile(version=2)))
    with pytest.raises(ProfileError, match=f"profile {old}: version 2, this planner reads version 1"):
        load_profile(old)
    zero = tmp_path / "zero.json"
    zero.write_bytes(msgspec.json.encode(profile(
        decode=[DecodePoint(context=100, concurrency=1, itl_ms=5, tokens_per_s=0)])))
    with pytest.raises(ProfileError, match="bad decode point"):
        load_profile(zero)
    assert issubclass(ProfileError, ValueError)
