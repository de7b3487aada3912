"""The mocker's step samples (``Engine.take_steps``): one per scheduler step that computed something,
as the load-mode planner fits step time on them. (vLLM's are tested in test_vllm_engine.py, on its
shared engine.)"""

from __future__ import annotations

import asyncio

from actors.engines.mocker.engine import MockerEngine
from actors.engines.mocker.ranks import MAX_STEP_SAMPLES
from actors.engines.mocker.timing import TimingModel
from actors.engines.protocol import SamplingOptions, StepSample, TokensPrompt

ARGS = {"speedup_ratio": 0, "block_size": 4, "num_gpu_blocks": 2048, "max_model_len": 8192}


async def run(e: MockerEngine, prompt: list[int], rid: str, max_tokens: int) -> None:
    async for _ in e.generate(TokensPrompt(prompt), SamplingOptions(max_tokens=max_tokens, ignore_eos=True), rid):
        pass


async def test_one_sample_per_step_then_none_when_idle() -> None:
    e = MockerEngine(ARGS)
    await e.start()
    try:
        assert e.take_steps() == []
        await run(e, list(range(100, 130)), "a", max_tokens=5)  # 30 prompt tokens, 5 generated
        steps = e.take_steps()
        # step 1 prefills the prompt and samples the first token; each later token is one decode step
        assert [(s.prefill_tokens, s.decode_requests) for s in steps] == [(30, 0)] + [(0, 1)] * 4
        # KV the batch held: 8 blocks of 4 up to the 32nd token, a ninth from the 33rd on (the last
        # step counts the blocks its finished request released at its end)
        assert [s.kv_tokens for s in steps] == [32, 32, 32, 36, 36]
        assert all(s.dp_rank == 0 and s.elapsed_ms >= 0 for s in steps)
        assert e.take_steps() == []  # taken means cleared
        await asyncio.sleep(0.05)
        assert e.take_steps() == []  # an idle engine records nothing
        # a repeat hits the prefix cache: only the uncached tail is computed
        await run(e, list(range(100, 130)), "b", max_tokens=1)
        [step] = e.take_steps()
        assert step.prefill_tokens == 30 - 28 and step.decode_requests == 0
    finally:
        await e.shutdown()


async def test_elapsed_includes_the_timing_model() -> None:
    e = MockerEngine({**ARGS, "speedup_ratio": 20})
    await e.start()
    try:
        await run(e, list(range(100, 164)), "a", max_tokens=3)
        steps = e.take_steps()
        model = TimingModel(20)
        assert len(steps) == 3
        for s in steps:
            blocks = s.kv_tokens // 4
            charged = model.step_seconds(s.prefill_tokens, s.decode_requests, blocks, 2048) * 1000
            assert charged > 0 and s.elapsed_ms >= charged * 0.9  # the simulated compute is in it
    finally:
        await e.shutdown()


async def test_samples_are_bounded_oldest_dropped() -> None:
    e = MockerEngine(ARGS)
    await e.start()
    try:
        await run(e, [7, 8, 9], "long", max_tokens=MAX_STEP_SAMPLES + 100)
        steps = e.take_steps()
        assert len(steps) == MAX_STEP_SAMPLES
        assert all(s.prefill_tokens == 0 and s.decode_requests == 1 for s in steps)  # the prefill went first
        assert steps[-1].kv_tokens == -(-(3 + MAX_STEP_SAMPLES + 99) // 4) * 4  # the newest: the last step
    finally:
        await e.shutdown()


async def test_data_parallel_ranks_sample_separately() -> None:
    e = MockerEngine({**ARGS, "dp_size": 2, "speedup_ratio": 1000})
    await e.start()
    try:
        await asyncio.gather(run(e, list(range(10, 30)), "x", 4), run(e, list(range(40, 52)), "y", 4))
        steps = e.take_steps()
        by_rank: dict[int, list[StepSample]] = {0: [], 1: []}
        for s in steps:
            by_rank[s.dp_rank].append(s)
        assert sorted(sum(s.prefill_tokens for s in r) for r in by_rank.values()) == [12, 20]
        assert [sum(s.decode_requests for s in r) for r in by_rank.values()] == [3, 3]
    finally:
        await e.shutdown()
