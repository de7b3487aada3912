"""bench/routing_bounds.py's simulation: it prices steps as the mocker does and keeps a prefix hit."""

from __future__ import annotations

import argparse
import random

import pytest

from actors.engines.mocker.timing import prefill_ms
from bench.routing_bench import Topo
from bench.routing_bounds import burst_ttfts, fastest_first, greedy, multi_turn_loop

TOPO = Topo(workers=2, block_size=16, num_gpu_blocks=4096, max_num_seqs=64, max_num_batched_tokens=8192,
            speedup_ratio=1.0)


def prompt(prefix: int, question: int) -> list[int]:
    rng = random.Random(question)
    return [1000 + prefix] * 2048 + [rng.randrange(100, 30000) for _ in range(128)]


def test_a_lone_request_waits_one_prefill_step_and_a_repeat_in_the_same_step_hits() -> None:
    alone = burst_ttfts(TOPO, [prompt(0, 0)], [0])
    assert alone == [pytest.approx(prefill_ms(2176))]
    # two questions on one prefix, one worker: the second is scheduled with the first and computes
    # only its question (the mocker caches blocks when it schedules them)
    both = burst_ttfts(TOPO, [prompt(0, 0), prompt(0, 1)], [0, 0])
    assert both == [pytest.approx(prefill_ms(2176 + 128))] * 2
    # on two workers each computes the prefix, alone in its step
    apart = burst_ttfts(TOPO, [prompt(0, 0), prompt(0, 1)], [0, 1])
    assert apart == [pytest.approx(prefill_ms(2176))] * 2


def test_online_assignments_keep_a_prefix_on_its_worker_and_balance_the_rest() -> None:
    prompts = [prompt(0, 0), prompt(1, 1), prompt(0, 2), prompt(2, 3)]
    assert greedy(TOPO, prompts, [0, 1, 0, 2]) == [0, 1, 0, 1]
    assert fastest_first(TOPO, prompts) == [0, 1, 0, 1]


def test_the_closed_loop_serves_every_turn_and_sticky_sessions_hit_more_than_round_robin() -> None:
    a = argparse.Namespace(seed=0, sessions=8, turns=3, active=4, output_tokens=8, gap=5.0, jitter=5.0)
    rr = multi_turn_loop(TOPO, "round_robin", 0.0, a)
    sticky = multi_turn_loop(TOPO, "sticky", 0.0, a)
    assert sticky.hit_rate > rr.hit_rate > 0.0
    assert rr.turns == sticky.turns == 8 * 3
    assert 0.0 < sticky.ttft_p50 <= sticky.ttft_p99 and sticky.makespan > 0.0
