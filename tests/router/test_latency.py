"""The latency predictor: step lines learned from step samples, workers ranked as those samples say,
the fallbacks before any sample (the pool's line, then the defaults), and soft session affinity."""

from __future__ import annotations

import random

import pytest

from actors.engines.protocol import StepSample
from actors.router.affinity import SessionAffinity
from actors.router.cost import RouterConfig
from actors.router.kv_router import KvRouter
from actors.router.latency import LatencyModel, PredictionError, StepFit, StepLine, WorkerState, default_line
from actors.worker.contract import LoadReport

BS = 16
A, B, C = ("a", 0), ("b", 0), ("c", 0)
IDLE = WorkerState(queued_prefill=0, kv_tokens=0, running=0, capacity_tokens=None)


def samples(line: StepLine, n: int = 200, seed: int = 0, noise: float = 0.0) -> list[StepSample]:
    """Steps a worker whose step time follows ``line`` would report: prefill and decode steps of many
    sizes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prefill = rng.choice([0, 0, rng.randrange(16, 4096)])
        kv = rng.randrange(0, 60_000)
        ms = line.base + (line.prefill_base if prefill else 0.0) + line.per_prefill * prefill + line.per_kv * kv
        out.append(StepSample(prefill_tokens=prefill, decode_requests=1 + i % 8, kv_tokens=kv,
                              elapsed_ms=ms * (1 + rng.uniform(-noise, noise))))
    return out


def report(worker: tuple[str, int], steps: list[StepSample], *, running: int = 0, total_blocks: int = 4096,
           active: int = 0) -> LoadReport:
    return LoadReport(instance=worker[0], dp_rank=worker[1], num_running=running, num_waiting=0, kv_usage=0.0,
                      active_kv_blocks=active, total_kv_blocks=total_blocks, steps=steps)


def router() -> KvRouter:
    return KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))


def tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(blocks * BS)]


# --- the fit -------------------------------------------------------------------------------------------
def test_the_fit_recovers_the_line_the_steps_follow() -> None:
    true = StepLine(base=4.0, prefill_base=12.0, per_prefill=0.02, per_kv=0.0003)
    fit = StepFit(default_line(65536))
    fit.add(samples(true, 400, noise=0.02))
    got = fit.line
    assert got.base == pytest.approx(4.0, rel=0.1)
    assert got.prefill_base == pytest.approx(12.0, rel=0.1)
    assert got.per_prefill == pytest.approx(0.02, rel=0.05)
    assert got.per_kv == pytest.approx(0.0003, rel=0.1)
    assert fit.max_prefill == max(s.prefill_tokens for s in samples(true, 400))


def test_a_feature_never_seen_keeps_its_default_and_none_goes_negative() -> None:
    prior = default_line(65536)
    fit = StepFit(prior)
    # decode steps only, whose time falls with KV (noise that happens to slope down): no prefill seen
    fit.add([StepSample(prefill_tokens=0, decode_requests=4, kv_tokens=200 * k, elapsed_ms=9.0 - 0.01 * k)
             for k in range(300)])
    got = fit.line
    assert got.per_prefill == pytest.approx(prior.per_prefill)
    assert got.prefill_base == pytest.approx(prior.prefill_base)
    assert got.per_kv == 0.0 and got.base > 0


def test_newer_steps_outweigh_older_ones() -> None:
    fit = StepFit(default_line(65536))
    fit.add(samples(StepLine(5.0, 10.0, 0.05, 0.0003), 500, seed=1))
    fit.add(samples(StepLine(5.0, 10.0, 0.01, 0.0003), 3000, seed=2))  # the engine got faster
    # most of the way to the new rate: the old steps have decayed to a few percent of the weight
    assert abs(fit.line.per_prefill - 0.01) < 0.1 * (0.05 - 0.01)


# --- ranking as the samples say ------------------------------------------------------------------------
def test_workers_rank_by_their_own_measured_prefill_rate() -> None:
    r = router()
    slow, fast = StepLine(5.0, 10.0, 0.05, 0.0003), StepLine(5.0, 10.0, 0.01, 0.0003)
    r.reconcile(report(A, samples(slow, seed=1)))
    r.reconcile(report(B, samples(fast, seed=2)))
    prompt = tokens(1, 64)  # 1,024 uncached tokens: 51 ms on a, 10 ms on b
    d = r.route(prompt, [A, B], book=False)
    assert d.worker == B
    by = {c.instance: c for c in d.costs}
    assert by["b"].cost < by["a"].cost
    assert by["a"].line == by["b"].line == "worker"
    assert by["a"].ttft_ms - by["b"].ttft_ms == pytest.approx(0.04 * 1024, rel=0.1)
    # the same samples the other way round: the choice follows them
    r2 = router()
    r2.reconcile(report(A, samples(fast, seed=1)))
    r2.reconcile(report(B, samples(slow, seed=2)))
    assert r2.route(prompt, [A, B], book=False).worker == A


def test_a_cache_hit_wins_until_the_queue_ahead_of_it_costs_more_than_the_miss() -> None:
    line = StepLine(5.0, 15.0, 0.015, 0.0005)
    r = router()
    for w in (A, B):
        r.reconcile(report(w, samples(line, seed=hash(w) % 100)))
    prefix = tokens(7, 128)  # 2,048 tokens
    first = r.route(prefix + tokens(8, 8), [A, B], request_id="first")
    r.finish("first")
    hit = r.route(prefix + tokens(9, 8), [A, B], book=False)
    assert hit.worker == first.worker and hit.overlap_blocks == 128
    # queue more uncached prefill on the worker holding the prefix than the miss would cost elsewhere
    for i in range(3):
        r.load.add_request(f"big{i}", first.worker, 4096)
    moved = r.route(prefix + tokens(10, 8), [A, B], book=False)
    assert moved.worker != first.worker and moved.overlap_blocks == 0


def test_running_streams_make_a_worker_dearer() -> None:
    line = StepLine(5.0, 15.0, 0.015, 0.0005)
    r = router()
    for w in (A, B):
        r.reconcile(report(w, samples(line)))
    for i in range(6):
        r.load.add_request(f"a{i}", A, 512)
        r.load.first_token(f"a{i}")
    d = r.route(tokens(3, 16), [A, B], book=False)
    by = {c.instance: c for c in d.costs}
    assert d.worker == B
    assert by["a"].stream_cost_ms > 0 == by["b"].stream_cost_ms


def test_a_full_cache_means_waiting_for_a_stream_to_end() -> None:
    m = LatencyModel()
    line_state = WorkerState(queued_prefill=0, kv_tokens=60_000, running=10, capacity_tokens=65_536)
    fits = m.estimate(A, line_state, prompt=1000, uncached=1000)
    full = m.estimate(A, WorkerState(0, 65_000, 10, 65_536), prompt=1000, uncached=1000)
    assert fits.wait_ms == 0 and full.wait_ms > 0
    assert full.ttft_ms > fits.ttft_ms + full.wait_ms * 0.99


# --- fallbacks -----------------------------------------------------------------------------------------
def test_before_any_sample_the_defaults_price_and_a_hit_still_wins() -> None:
    r = router()
    prefix = tokens(11, 32)
    first = r.route(prefix, [A, B, C], request_id="x")
    r.finish("x")
    d = r.route(prefix + tokens(12, 4), [A, B, C], book=False)
    assert d.worker == first.worker and d.overlap_blocks == 32
    assert {c.line for c in d.costs} == {"default"}
    assert all(c.ttft_ms is not None and c.ttft_ms > 0 for c in d.costs)


def test_a_worker_without_samples_borrows_the_pools_line() -> None:
    r = router()
    line = StepLine(5.0, 10.0, 0.03, 0.0003)
    r.reconcile(report(A, samples(line)))
    r.reconcile(report(B, []))  # reporting, but no step yet (just started)
    d = r.route(tokens(5, 8), [A, B, C], book=False)
    by = {c.instance: c for c in d.costs}
    assert by["a"].line == "worker" and by["b"].line == "pool" and by["c"].line == "pool"
    # the same line, the same price: an equal choice, not one skewed by the defaults
    assert by["a"].ttft_ms == pytest.approx(by["b"].ttft_ms)


def test_a_removed_worker_takes_its_line_and_bindings_with_it() -> None:
    r = router()
    r.reconcile(report(A, samples(StepLine(5.0, 10.0, 0.03, 0.0003))))
    r.route(tokens(1, 4), [A], request_id="q", session="s1")
    assert r.sessions.bound("s1") == A
    r.remove_worker("a")
    assert r.latency.fit_for(A) == (None, "default")
    assert r.sessions.bound("s1") is None


def test_the_weights_stay_an_override() -> None:
    r = KvRouter(RouterConfig(block_size=BS, prefill_load_scale=8.0), rng=random.Random(0))
    d = r.route(tokens(1, 10), [A, B], book=False)
    assert d.cost_model == "weights" and d.cost == pytest.approx(80.0)
    assert r.stats()["cost_model"] == "weights"


# --- session affinity ----------------------------------------------------------------------------------
def test_a_session_stays_on_its_worker_while_it_is_not_overloaded() -> None:
    r = router()
    line = StepLine(5.0, 15.0, 0.015, 0.0005)
    for w in (A, B):
        r.reconcile(report(w, samples(line)))
    first = r.route(tokens(1, 8), [A, B], request_id="t0", session="chat-1")
    r.finish("t0")
    other = B if first.worker == A else A
    r.load.add_request("light", first.worker, 256)  # a little load: the other worker is now cheaper
    r.load.first_token("light")
    # an unrelated prompt (nothing cached to keep it there) follows the session
    kept = r.route(tokens(2, 8), [A, B], request_id="t1", session="chat-1")
    assert kept.worker == first.worker
    assert r.route(tokens(2, 8), [A, B], book=False).worker == other  # without the session: the cheaper one
    r.finish("t1")
    for i in range(4):  # now heavily loaded: far above twice the cheapest
        r.load.add_request(f"heavy{i}", first.worker, 8192)
    moved = r.route(tokens(3, 8), [A, B], request_id="t2", session="chat-1")
    assert moved.worker == other and r.sessions.bound("chat-1") == other
    assert {k: v for k, v in ((s.labels["outcome"], s.value) for s in
                             r.metrics.session_affinity.collect()[0].samples if s.name.endswith("_total"))} == {
        "first": 1.0, "kept": 1.0, "moved": 1.0}


def test_bindings_expire_and_are_bounded() -> None:
    now = [0.0]
    aff = SessionAffinity(10.0, max_sessions=3, clock=lambda: now[0])
    aff.bind("s1", A)
    now[0] = 5.0
    assert aff.bound("s1") == A
    now[0] = 16.0
    assert aff.bound("s1") is None
    for i in range(5):
        aff.bind(f"n{i}", B)
    assert len(aff) == 3 and aff.bound("n0") is None and aff.bound("n4") == B
    now[0] = 100.0
    aff.bind("late", C)  # every older binding has expired: cleared by this bind
    assert len(aff) == 1


def test_with_nothing_cached_a_short_queue_beats_few_running_streams() -> None:
    """Prompts that share nothing: only the TTFT and the decode ITL count, so a worker whose streams
    are all decoding takes the request over an idle-looking one with prefills queued."""
    line = StepLine(5.0, 15.0, 0.015, 0.0005)
    r = router()
    for w in (A, B):
        r.reconcile(report(w, samples(line)))
    for i in range(6):  # a: six streams past their prefill
        r.load.add_request(f"a{i}", A, 512)
        r.load.first_token(f"a{i}")
    for i in range(3):  # b: three prefills of 2k tokens still queued
        r.load.add_request(f"b{i}", B, 2048)
    d = r.route(tokens(4, 64), [A, B], book=False)
    by = {c.instance: c for c in d.costs}
    assert d.worker == A and by["a"].ttft_ms < by["b"].ttft_ms
    # the decode ITL it adds to a's six streams is charged, and nothing else
    assert by["a"].stream_cost_ms == pytest.approx(6 * r.latency.line(A)[0].per_kv * 64 * BS)


def test_the_prefill_another_worker_would_skip_is_charged_to_the_streams_it_stalls() -> None:
    line = StepLine(5.0, 15.0, 0.015, 0.0005)
    r = router()
    for w in (A, B):
        r.reconcile(report(w, samples(line)))
    prefix = tokens(21, 64)
    first = r.route(prefix, [A, B], request_id="p")
    r.finish("p")
    other = B if first.worker == A else A
    for i in range(4):
        r.load.add_request(f"o{i}", other, 256)
        r.load.first_token(f"o{i}")
    d = r.route(prefix + tokens(22, 4), [A, B], book=False)
    by = {c.instance: c for c in d.costs}
    fitted = r.latency.line(other)[0]
    per_kv_part = 4 * fitted.per_kv * 68 * BS
    assert by[other[0]].stream_cost_ms == pytest.approx(per_kv_part + 4 * fitted.per_prefill * 64 * BS)
    assert by[first.instance].stream_cost_ms == 0 and d.worker == first.worker


# --- sampling within the model's own error ------------------------------------------------------------
def test_the_prediction_error_is_a_bias_and_a_spread() -> None:
    err = PredictionError(alpha=0.01)
    assert err.spread_ms == 0.0  # nothing measured: the predictions are trusted
    for actual, predicted in [(30.0, 20.0), (40.0, 20.0), (50.0, 20.0)]:  # residuals 10, 20, 30
        err.observe(actual, predicted)
    assert err.bias_ms == pytest.approx(20.0)
    assert err.spread_ms == pytest.approx((200 / 3) ** 0.5)  # their standard deviation
    err.observe(float("nan"), 1.0)
    assert err.samples == 3
    for i in range(400):  # then the newest ~100 count
        err.observe(100.0 + (5.0 if i % 2 else -5.0), 80.0)
    assert err.bias_ms == pytest.approx(20.0, abs=0.5) and err.spread_ms == pytest.approx(5.0, rel=0.1)


def test_the_router_measures_its_error_at_each_first_token() -> None:
    clock = [100.0]
    r = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0), clock=lambda: clock[0])
    for w in (A, B):
        r.reconcile(report(w, samples(StepLine(5.0, 15.0, 0.015, 0.0005))))
    for i, late_ms in enumerate((10.0, 30.0)):
        d = r.route(tokens(40 + i, 32), [A, B], request_id=f"q{i}")
        predicted = next(c.ttft_ms for c in d.costs if (c.instance, c.dp_rank) == d.worker)
        clock[0] += (predicted + late_ms) / 1e3
        r.first_token(f"q{i}")
        r.finish(f"q{i}")
    err = r.latency.error
    assert err.samples == 2
    assert err.bias_ms == pytest.approx(20.0, abs=0.01) and err.spread_ms == pytest.approx(10.0, abs=0.01)
    r.route(tokens(50, 8), [A, B], request_id="lost")
    r.finish("lost")  # finished without a first token (failed): nothing to measure
    r.first_token("lost")
    assert err.samples == 2


def test_loads_the_model_cannot_tell_apart_are_sampled_but_cached_prefixes_are_not() -> None:
    line = StepLine(5.0, 15.0, 0.015, 0.0005)
    r = router()
    for w in (A, B, C):
        r.reconcile(report(w, samples(line)))
    r.load.add_request("c0", C, 256)  # c: a short prefill queued, dearer by about one prefill step
    fresh = tokens(60, 64)

    def picks(n: int, prompt: list[int] = fresh) -> list[str]:
        return [r.route(prompt, [A, B, C], book=False).instance for _ in range(n)]

    assert set(picks(300)) == {"a", "b"}  # nothing measured yet: the cheapest (a tie, so both of them)
    for _ in range(400):  # the predictions turn out right
        r.latency.observe_ttft(50.0, 50.0)
    assert set(picks(300)) == {"a", "b"}
    for i in range(400):  # the predictions turn out off by ±15 ms
        r.latency.observe_ttft(50.0 + (15.0 if i % 2 else -15.0), 50.0)
    assert r.latency.error.spread_ms == pytest.approx(15.0, rel=0.05)
    noisy = picks(600)
    assert set(noisy) == {"a", "b", "c"} and noisy.count("c") < noisy.count("a")
    # a prefix cached on c alone: the saving is exact, not sampled away, even when smaller than the spread
    r.load.finish("c0")
    prefix = tokens(61, 40)  # 640 tokens: ~10 ms of prefill saved, less than the 15 ms spread
    r.route(prefix, [C], request_id="warm")
    r.finish("warm")
    assert set(picks(300, prefix + tokens(62, 4))) == {"c"}


def test_steps_of_tiny_prefills_do_not_shrink_the_chunk() -> None:
    """A router that has seen only health canaries (1-token prefills, as a frontend process started
    after its workers sees) prices a 1,000-token prompt as one prefill step, not 1,000."""
    w = ("a", 0)
    canaries = [StepSample(prefill_tokens=1, decode_requests=0, kv_tokens=0, elapsed_ms=8.015) for _ in range(20)]
    m = LatencyModel()
    m.observe(w, canaries, 65536)
    _, chunk, _ = m.line(w)
    assert chunk >= 2048
    est = m.estimate(w, WorkerState(queued_prefill=0, kv_tokens=0, running=0, capacity_tokens=65536), 1000, 1000)
    assert est.ttft_ms < 100.0, est
