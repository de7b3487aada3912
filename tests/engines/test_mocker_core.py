"""Unit tests of the mocker's block pool, scheduler and timing model (no asyncio, no ZMQ)."""

from __future__ import annotations

import math

import pytest

from actors.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from actors.engines.mocker import tokens as tk
from actors.engines.mocker.config import MockerArgs
from actors.engines.mocker.kv_pool import BlockPool
from actors.engines.mocker.scheduler import MockRequest, Scheduler
from actors.engines.mocker.timing import TimingModel, decode_ms, parse_speedup, prefill_ms

BS = 4


def make_sched(num_blocks: int = 64, budget: int = 1000, max_seqs: int = 16, chunked: bool = True,
               max_model_len: int = 128) -> Scheduler:
    pool = BlockPool(num_blocks, BS)
    return Scheduler(pool, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked, max_loras=1,
                     sample=lambda r: tk.token_after(r.all_tokens[-tk.HISTORY:], r.num_tokens, 1000, 0))


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> MockRequest:
    return MockRequest(request_id=rid, prompt=prompt, max_tokens=max_tokens, **kw)


def run_to_end(s: Scheduler, limit: int = 10_000) -> list:
    results = []
    while s.has_work():
        results.append(s.step())
        assert len(results) < limit
    return results


# --- pool --------------------------------------------------------------------------------------
def test_pool_free_lru_eviction_order() -> None:
    pool = BlockPool(4, BS)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [0, 1] and b == [2, 3] and pool.allocate(1) is None
    pool.cache_blocks(a, [101, 102], None, list(range(8)), None, None)
    pool.cache_blocks(b, [201, 202], None, list(range(8, 16)), None, None)
    pool.free_blocks(list(reversed(b)))  # request b ends first: its tail goes to the LRU head
    pool.free_blocks(list(reversed(a)))
    assert list(pool.free) == [3, 2, 1, 0]
    pool.take_events()
    got = pool.allocate(3)
    assert got == [3, 2, 1]
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [202, 201, 102]
    assert pool.lookup([101, 102]) == [0]  # block 0 still cached, block 1 was evicted


def test_pool_prefix_hit_takes_block_off_free_queue() -> None:
    pool = BlockPool(2, BS)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [7, 8], None, list(range(8)), None, None)
    pool.free_blocks(list(reversed(blocks)))
    hits = pool.lookup([7, 8, 9])
    assert hits == [0, 1]
    pool.touch(hits[:1])
    assert pool.num_free == 1 and pool.ref_cnt[0] == 1
    assert pool.allocate(1) == [1]  # the touched block can no longer be evicted
    assert pool.allocate(1) is None


def test_pool_events_shape_and_reset() -> None:
    pool = BlockPool(4, BS)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [1, 2], None, list(range(8)), 3, "ad")
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [1, 2] and ev.token_ids == list(range(8)) and ev.block_size == BS
    assert ev.lora_name == "ad" and ev.lora_id == 3 and ev.extra_keys == [("ad",), ("ad",)]
    assert ev.medium == "GPU" and ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention"
    assert pool.reset_prefix_cache() is False  # blocks in use, like vLLM
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert isinstance(pool.take_events()[0], AllBlocksCleared)
    assert pool.lookup([1]) == []


def test_block_hash_chains_and_lora_changes_it() -> None:
    h1 = tk.block_hash(None, [1, 2, 3, 4], None)
    assert h1 == tk.block_hash(None, [1, 2, 3, 4], None)
    assert 0 <= h1 < 2**64
    assert tk.block_hash(h1, [5, 6, 7, 8], None) != tk.block_hash(None, [5, 6, 7, 8], None)
    assert tk.block_hash(None, [1, 2, 3, 4], ("lora-a",)) != h1


# --- scheduler ---------------------------------------------------------------------------------
def test_prefix_hit_on_repeated_prompt() -> None:
    s = make_sched()
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks below num_tokens - 1
    r1 = req("a", prompt)
    s.add(r1)
    run_to_end(s)
    r2 = req("b", prompt)
    s.add(r2)
    run_to_end(s)
    assert r1.cached_tokens == 0 and r2.cached_tokens == 16
    assert r1.output == r2.output
    assert s.prefix_queries == 36 and s.prefix_hits == 16
    r3 = req("c", list(range(1, 9)) + [999] * 10)  # shares 2 blocks
    s.add(r3)
    run_to_end(s)
    assert r3.cached_tokens == 8


def test_a_request_hits_the_prefix_another_computes_in_the_same_step() -> None:
    """vLLM v1 caches blocks when it schedules them (allocate_slots): the second of two requests
    with the same prefix, admitted in the same step, computes only what the first does not."""
    s = make_sched()
    prefix = list(range(1, 17))  # 4 full blocks
    a, b = req("a", prefix + [50, 51]), req("b", prefix + [60, 61])
    s.add(a)
    s.add(b)
    first = s.step()
    assert first.scheduled == {"a": 18, "b": 2}
    assert first.prefill_tokens == 20
    assert a.cached_tokens == 0 and b.cached_tokens == 16
    stored = [h for e in s.pool.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == a.block_hashes[:4]  # announced once, by the request that computes them
    run_to_end(s)
    assert len(a.output) == len(b.output) == 4


def test_chunked_prefill_spreads_long_prompt_over_steps() -> None:
    s = make_sched(budget=16)
    r = req("long", list(range(50)), max_tokens=2)
    s.add(r)
    results = run_to_end(s)
    assert [res.scheduled["long"] for res in results] == [16, 16, 16, 2, 1]
    assert [res.prefill_tokens for res in results[:4]] == [16, 16, 16, 2]
    assert all(not res.sampled for res in results[:3])  # no token until the prompt is done
    assert len(r.output) == 2 and r.finish_reason == "length"


def test_no_chunking_waits_for_budget() -> None:
    s = make_sched(budget=128, chunked=False)
    a, b = req("a", list(range(100)), max_tokens=3), req("b", list(range(200, 260)), max_tokens=3)
    s.add(a)
    s.add(b)
    first = s.step()
    assert first.scheduled == {"a": 100}  # b (60 tokens) does not fit in the remaining 28
    second = s.step()
    assert second.scheduled == {"a": 1, "b": 60}


def test_token_budget_and_max_num_seqs() -> None:
    s = make_sched(budget=10, max_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", [i + 1] * 3, max_tokens=3))
    res = s.step()
    assert res.scheduled == {"r0": 3, "r1": 3}  # max_num_seqs=2
    assert len(s.waiting) == 2
    run_to_end(s)


def test_preemption_when_blocks_run_out_and_requests_complete() -> None:
    # 12 blocks of 4 tokens; 3 requests of 12-token prompts growing to 24 tokens need 18 blocks.
    s = make_sched(num_blocks=12, max_model_len=48)
    reqs = [req(f"r{i}", [10 * i + j for j in range(12)], max_tokens=12) for i in range(3)]
    for r in reqs:
        s.add(r)
    results = run_to_end(s)
    preempted = [p.request_id for res in results for p in res.preempted]
    assert preempted and preempted[0] == "r2"  # the last running request is the victim (FCFS)
    assert all(r.finish_reason == "length" and len(r.output) == 12 for r in reqs)
    assert s.pool.num_used == 0
    # recompute-style preemption keeps the output identical to an unpressured run
    solo = make_sched(num_blocks=64, max_model_len=48)
    for r in reqs:
        again = req(r.request_id, r.prompt, max_tokens=12)
        solo.add(again)
        run_to_end(solo)
        assert again.output == r.output


def test_eos_stop_ids_min_tokens() -> None:
    s = make_sched()
    prompt = [5, 6, 7]
    probe = req("p", prompt, max_tokens=5)
    s.add(probe)
    run_to_end(s)
    third = probe.output[2]
    r = req("eos", prompt, max_tokens=5, eos_token_id=third)
    s.add(r)
    run_to_end(s)
    assert r.output == probe.output[:3] and r.finish_reason == "stop" and r.stop_reason is None
    r2 = req("stopid", prompt, max_tokens=5, stop_token_ids=frozenset({probe.output[1]}))
    s.add(r2)
    run_to_end(s)
    assert r2.finish_reason == "stop" and r2.stop_reason == probe.output[1] and len(r2.output) == 2


def test_max_model_len_caps_output() -> None:
    s = make_sched(max_model_len=20)
    r = req("x", list(range(15)), max_tokens=100)
    s.add(r)
    run_to_end(s)
    assert r.num_tokens == 20 and r.finish_reason == "length"


def test_remote_prefill_tokens_skip_compute() -> None:
    s = make_sched()
    r = req("d", list(range(40)), max_tokens=3, remote_prefill_tokens=39)
    s.add(r)
    first = s.step()
    assert first.scheduled == {"d": 1} and first.prefill_tokens == 1
    assert r.cached_tokens == 39 and len(r.output) == 1


# --- timing ------------------------------------------------------------------------------------
def test_timing_model_numbers() -> None:
    assert prefill_ms(0) == 0.0
    assert prefill_ms(1000) == pytest.approx(4.209989e-07 * 1e6 + 15.18344 + 16.50142)
    assert prefill_ms(4096) == pytest.approx(4.209989e-07 * 4096**2 + 1.518344e-02 * 4096 + 16.50142)
    assert decode_ms(0, 100) == pytest.approx(5.74)
    assert decode_ms(50, 100) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert decode_ms(200, 100) == pytest.approx(-25.74 + 54.01 + 5.74)  # clamped at full
    t = TimingModel(2.0)
    assert t.step_seconds(1000, 3, 50, 100) == pytest.approx((prefill_ms(1000) + decode_ms(50, 100)) / 2000)
    assert t.step_seconds(0, 0, 0, 100) == 0.0
    for zero in (0, "inf", math.inf, "0"):
        m = TimingModel(zero)
        assert m.zero_compute and m.step_seconds(5000, 10, 90, 100) == 0.0
    with pytest.raises(ValueError):
        parse_speedup(-1)


def test_args_validation() -> None:
    with pytest.raises(ValueError, match="'bogus_key'"):
        MockerArgs.from_dict({"bogus_key": 1})
    with pytest.raises(ValueError, match="max_model_len"):
        MockerArgs.from_dict({"num_gpu_blocks": 2, "block_size": 4, "max_model_len": 64})
    a = MockerArgs.from_dict({"speedup_ratio": "inf", "block_size": 32})
    assert a.zero_compute and a.block_size == 32
