"""MockerEngine behaviour through the Engine protocol (zero compute unless a test says otherwise)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.engines.mocker.tokens import predict_output, tokenize_text
from actors.engines.protocol import (
    EmbedsPrompt,
    EngineDeadError,
    EngineOutput,
    LoraRef,
    SamplingOptions,
    TextPrompt,
    TokensPrompt,
)

ARGS = {"speedup_ratio": 0, "block_size": 4, "num_gpu_blocks": 256, "max_model_len": 256}
PROMPT = list(range(100, 130))  # 30 tokens


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    e = MockerEngine(ARGS)
    await e.start()
    yield e
    await e.shutdown()


async def collect(e: MockerEngine, prompt, rid: str, **kw) -> list[EngineOutput]:
    lora = kw.pop("lora", None)
    params = kw.pop("kv_transfer_params", None)
    return [o async for o in e.generate(prompt, SamplingOptions(**kw), rid, lora=lora,
                                        kv_transfer_params=params)]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def test_deterministic_predictable_output(engine: MockerEngine) -> None:
    outs = await collect(engine, TokensPrompt(PROMPT), "a", max_tokens=12)
    assert tokens(outs) == predict_output(PROMPT, 12, 32000, eos_token_id=2)
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert outs[0].num_prompt_tokens == 30
    assert "".join(o.text or "" for o in outs) == "".join(f" t{t}" for t in tokens(outs))
    again = await collect(engine, TokensPrompt(PROMPT), "b", max_tokens=12)
    assert tokens(again) == tokens(outs)
    seeded = await collect(engine, TokensPrompt(PROMPT), "c", max_tokens=12, seed=7)
    assert tokens(seeded) != tokens(outs)
    other = MockerEngine(ARGS, seed=1)
    await other.start()
    try:
        assert tokens(await collect(other, TokensPrompt(PROMPT), "d", max_tokens=12)) != tokens(outs)
    finally:
        await other.shutdown()


async def test_prefix_cache_hit_reported(engine: MockerEngine) -> None:
    first = await collect(engine, TokensPrompt(PROMPT), "a", max_tokens=4)
    second = await collect(engine, TokensPrompt(PROMPT), "b", max_tokens=4)
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == 28  # 7 full blocks of 4 within the first 29 tokens
    (st,) = engine.stats()
    assert st.prefix_queries == 60 and st.prefix_hits == 28 and st.prefix_hit_rate == pytest.approx(28 / 60)
    assert st.num_running == 0 and st.kv_usage == 0.0 and st.total_kv_blocks == 256
    assert await engine.reset_prefix_cache() is True
    third = await collect(engine, TokensPrompt(PROMPT), "c", max_tokens=4)
    assert third[-1].cached_tokens == 0


async def test_eos_ignore_eos_min_tokens_stop_ids() -> None:
    ref = predict_output(PROMPT, 10, 32000, eos_token_id=None)
    eos = ref[3]
    e = MockerEngine({**ARGS, "eos_token_id": eos})
    await e.start()
    try:
        outs = await collect(e, TokensPrompt(PROMPT), "a", max_tokens=10)
        assert tokens(outs) == ref[:4] and outs[-1].finish_reason == "stop"
        outs = await collect(e, TokensPrompt(PROMPT), "b", max_tokens=10, ignore_eos=True)
        assert tokens(outs) == ref and outs[-1].finish_reason == "length"
        outs = await collect(e, TokensPrompt(PROMPT), "c", max_tokens=10, min_tokens=6)
        assert eos not in tokens(outs)[:6] and len(tokens(outs)) >= 6
        assert tokens(outs) == predict_output(PROMPT, 10, 32000, eos_token_id=eos, min_tokens=6)
        outs = await collect(e, TokensPrompt(PROMPT), "d", max_tokens=10, stop_token_ids=[ref[1]],
                             ignore_eos=True)
        assert tokens(outs) == ref[:2] and outs[-1].stop_reason == ref[1]
    finally:
        await e.shutdown()


async def test_text_and_embeds_prompts(engine: MockerEngine) -> None:
    outs = await collect(engine, TextPrompt("hello world"), "t", max_tokens=3)
    assert outs[-1].num_prompt_tokens == 11
    assert tokens(outs) == predict_output(tokenize_text("hello world"), 3, 32000, eos_token_id=2)
    rows = [[float(i), float(i) / 2] for i in range(9)]
    e1 = await collect(engine, EmbedsPrompt(tensor=rows), "e1", max_tokens=3)
    e2 = await collect(engine, EmbedsPrompt(tensor=[rows]), "e2", max_tokens=3)  # [1, seq, hidden]
    assert e1[-1].num_prompt_tokens == 9 and tokens(e1) == tokens(e2)
    assert e2[-1].cached_tokens == 8
    logp = await collect(engine, TokensPrompt(PROMPT), "lp", max_tokens=2, logprobs=3, detokenize=False)
    lps = [lp for o in logp for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens(logp) and all(len(lp.top) == 3 for lp in lps)
    assert all(lp.logprob < 0 and lp.top[0][0] == lp.token_id for lp in lps)
    assert all(o.text is None for o in logp)


async def test_rejects_bad_requests(engine: MockerEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, TokensPrompt(list(range(300))), "x")
    with pytest.raises(ValueError, match="enable_lora"):
        await collect(engine, TokensPrompt(PROMPT), "y", lora=LoraRef("a", 1, "/nope"))
    with pytest.raises(ValueError, match="'max_num_batched'"):
        MockerEngine({"max_num_batched": 5})


async def test_refuses_what_vllm_refuses_before_allocating(engine: MockerEngine) -> None:
    """vLLM's limits with vLLM's words, checked before the request exists: ``logprobs: 2**63``
    once built a list entry per requested logprob until the OOM killer stopped the worker."""
    assert engine.facts.max_logprobs == 20 and engine.facts.vocab_size == 32000
    refusals = [
        ({"logprobs": 2**63}, "Requested sample logprobs of 9223372036854775808, which is greater than max "
                              "allowed: 20"),
        ({"logprobs": 21}, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        ({"extra": {"prompt_logprobs": 21}}, "Requested prompt logprobs of 21"),
        ({"top_k": 32001}, r"top_k must be at most the vocabulary size \(32000\)"),
        ({"top_k": -2}, r"top_k must be 0 \(disable\), or at least 1"),
        ({"stop_token_ids": [32000]}, r"token_id\(s\) \[32000\] in stop_token_ids contain out-of-vocab"),
        ({"extra": {"logit_bias": {2**64: 1.0}}}, "in logit_bias contain out-of-vocab token ids"),
        ({"extra": {"allowed_token_ids": [-1]}}, "in allowed_token_ids contain out-of-vocab"),
    ]
    for kw, words in refusals:
        with pytest.raises(ValueError, match=words):
            await collect(engine, TokensPrompt(PROMPT), "x", max_tokens=2, **kw)
    with pytest.raises(ValueError, match="Token id 32000 is out of vocabulary"):
        await collect(engine, TokensPrompt([1, 32000]), "x", max_tokens=2)
    assert all(not r.sched.requests for r in engine._ranks)  # nothing was admitted
    ok = await collect(engine, TokensPrompt(PROMPT), "ok", max_tokens=2, logprobs=20, top_k=32000)
    assert all(len(lp.top) == 20 for o in ok for lp in o.logprobs or [])


async def test_max_logprobs_arg() -> None:
    e = MockerEngine({**ARGS, "max_logprobs": 40, "vocab_size": 64})
    await e.start()
    try:
        assert e.facts.max_logprobs == 40
        outs = await collect(e, TokensPrompt([1, 2]), "a", max_tokens=2, logprobs=40)
        assert all(len(lp.top) == 40 for o in outs for lp in o.logprobs or [])
        with pytest.raises(ValueError, match="max allowed: 40"):
            await collect(e, TokensPrompt([1, 2]), "b", max_tokens=2, logprobs=41)
    finally:
        await e.shutdown()
    for bad in (-2, "20", True):
        with pytest.raises(ValueError, match="max_logprobs"):
            MockerEngine({"max_logprobs": bad})
    e = MockerEngine({**ARGS, "max_logprobs": -1, "vocab_size": 64})  # vLLM's -1: the whole vocabulary
    await e.start()
    try:
        outs = await collect(e, TokensPrompt([1, 2]), "c", max_tokens=1, logprobs=-1)
        assert all(len(lp.top) == 64 for o in outs for lp in o.logprobs or [])
    finally:
        await e.shutdown()


async def test_abort_mid_stream() -> None:
    e = MockerEngine({**ARGS, "speedup_ratio": 1000})
    await e.start()
    try:
        got: list[EngineOutput] = []

        async def consume() -> None:
            async for o in e.generate(TokensPrompt(PROMPT), SamplingOptions(max_tokens=200), "ab"):
                got.append(o)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.001)
        await e.abort("ab")
        await asyncio.wait_for(task, 5)
        assert got[-1].finish_reason == "abort" and len(tokens(got)) < 200
        assert e.stats()[0].num_running == 0 and e.stats()[0].active_kv_blocks == 0
    finally:
        await e.shutdown()


async def test_timing_model_applies_delay() -> None:
    # 2 decode steps at speedup 100 take >= 2 * 5.74 / 100 ms: the run cannot finish in 0 time.
    e = MockerEngine({**ARGS, "speedup_ratio": 10})
    await e.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await collect(e, TokensPrompt(PROMPT), "a", max_tokens=3)
        # prefill of 30 tokens (~17 ms) + 2 decodes (~5.8 ms each), / 10
        assert loop.time() - t0 >= (16.5 + 2 * 5.74) / 10 / 1000
    finally:
        await e.shutdown()


async def test_sleep_blocks_requests_until_wake(engine: MockerEngine) -> None:
    await collect(engine, TokensPrompt(PROMPT), "warm", max_tokens=2)
    await engine.sleep(1)
    assert await engine.is_sleeping()
    task = asyncio.create_task(collect(engine, TokensPrompt(PROMPT), "s", max_tokens=2))
    await asyncio.sleep(0.05)
    assert not task.done() and engine.stats()[0].num_waiting == 1
    await engine.wake_up()
    outs = await asyncio.wait_for(task, 5)
    assert not await engine.is_sleeping()
    assert outs[-1].cached_tokens == 0  # level 1 cleared the prefix cache


async def test_die_after_tokens_and_inject_death() -> None:
    e = MockerEngine({**ARGS, "die_after_tokens": 5})
    await e.start()
    got: list[int] = []
    with pytest.raises(EngineDeadError):
        async for o in e.generate(TokensPrompt(PROMPT), SamplingOptions(max_tokens=50), "a"):
            got.extend(o.token_ids)
    assert len(got) == 5 and e.dead.is_set()
    with pytest.raises(EngineDeadError):
        await e.check_health()
    with pytest.raises(EngineDeadError):
        await collect(e, TokensPrompt(PROMPT), "b")
    await e.shutdown()

    e2 = MockerEngine({**ARGS, "speedup_ratio": 1000})
    await e2.start()
    task = asyncio.create_task(collect(e2, TokensPrompt(PROMPT), "c", max_tokens=10_000 // 50))
    await asyncio.sleep(0.02)
    e2.inject_death()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, 5)
    assert e2.kv_event_sources() == []  # the publisher died with the engine
    await e2.shutdown()


async def test_die_at_start() -> None:
    e = MockerEngine({**ARGS, "die_at_start": True})
    with pytest.raises(EngineDeadError):
        await e.start()
    assert e.dead.is_set()


async def test_hang_stalls_stream_but_health_passes() -> None:
    e = MockerEngine({**ARGS, "hang_after_tokens": 3})
    await e.start()
    try:
        got: list[int] = []

        async def consume() -> None:
            async for o in e.generate(TokensPrompt(PROMPT), SamplingOptions(max_tokens=20), "h"):
                got.extend(o.token_ids)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        assert len(got) == 3 and not task.done()
        await e.check_health()
        e.clear_hang()
        await asyncio.wait_for(task, 5)
        assert len(got) == 20  # the stalled stream resumes where it stopped
        e.inject_hang()
        t2 = asyncio.create_task(collect(e, TokensPrompt(PROMPT), "h2", max_tokens=2))
        await asyncio.sleep(0.05)
        assert not t2.done()
        e.clear_hang()
        await asyncio.wait_for(t2, 5)
    finally:
        await e.shutdown()


async def test_lora_changes_output_and_bookkeeping() -> None:
    e = MockerEngine({**ARGS, "enable_lora": True, "max_loras": 1, "max_cpu_loras": 2})
    await e.start()
    try:
        a, b, c = LoraRef("a", 1, "/a"), LoraRef("b", 2, "/b"), LoraRef("c", 3, "/c")
        base = tokens(await collect(e, TokensPrompt(PROMPT), "base", max_tokens=6))
        with_a = tokens(await collect(e, TokensPrompt(PROMPT), "la", max_tokens=6, lora=a))
        assert with_a != base
        assert with_a == predict_output(PROMPT, 6, 32000, eos_token_id=2, lora_name="a")
        again = await collect(e, TokensPrompt(PROMPT), "la2", max_tokens=6, lora=a)
        assert tokens(again) == with_a and again[-1].cached_tokens == 28
        assert await e.list_loras() == [1]  # loaded on demand
        assert await e.add_lora(b) and await e.add_lora(c)  # capacity 2: "a" is evicted (LRU)
        assert await e.list_loras() == [2, 3]
        assert await e.remove_lora(b) is True and await e.remove_lora(b) is False
        assert await e.list_loras() == [3]
        # two adapters with max_loras=1 still both complete (the second waits for the slot)
        r1, r2 = await asyncio.gather(collect(e, TokensPrompt(PROMPT), "x", max_tokens=3, lora=a),
                                      collect(e, TokensPrompt(PROMPT), "y", max_tokens=3, lora=c))
        assert r1[-1].finish_reason == r2[-1].finish_reason == "length"
    finally:
        await e.shutdown()


async def test_prefill_decode_handoff() -> None:
    pre = MockerEngine(ARGS, role="prefill")
    dec = MockerEngine(ARGS, role="decode")
    agg = MockerEngine(ARGS)
    for e in (pre, dec, agg):
        await e.start()
    try:
        assert dec.kv_event_sources() == [] and len(pre.kv_event_sources()) == 1
        p_out = await collect(pre, TokensPrompt(PROMPT), "p", max_tokens=50,
                              kv_transfer_params={"do_remote_decode": True})
        assert len(tokens(p_out)) == 1  # prefill role forces max_tokens=1
        params = p_out[-1].kv_transfer_params
        assert params is not None and params["do_remote_prefill"] is True
        assert params["remote_engine_id"] == pre.engine_id and params["remote_num_tokens"] == 30
        assert len(params["remote_block_ids"][0]) == 8  # 31 tokens in blocks of 4
        d_out = await collect(dec, TokensPrompt(PROMPT), "d", max_tokens=10, kv_transfer_params=params)
        assert dec.received_kv_transfer_params == [params]
        assert d_out[-1].cached_tokens == 29  # every prompt token but the last came from prefill
        (st,) = dec.stats()
        assert st.prefix_hits == 0  # hand-off, not a local prefix hit
        a_out = await collect(agg, TokensPrompt(PROMPT), "a", max_tokens=10)
        assert tokens(d_out) == tokens(a_out) and tokens(d_out)[0] == tokens(p_out)[0]
    finally:
        for e in (pre, dec, agg):
            await e.shutdown()


async def test_data_parallel_ranks_spread_load() -> None:
    e = MockerEngine({**ARGS, "dp_size": 2, "speedup_ratio": 1000})
    await e.start()
    try:
        srcs = e.kv_event_sources()
        assert [s.dp_rank for s in srcs] == [0, 1] and srcs[0].endpoint != srcs[1].endpoint
        outs = await asyncio.gather(*(collect(e, TokensPrompt([i + 1] * 20), f"r{i}", max_tokens=5)
                                      for i in range(6)))
        assert all(o[-1].finish_reason == "length" for o in outs)
        st = e.stats()
        assert len(st) == 2 and st[0].step > 0 and st[1].step > 0
    finally:
        await e.shutdown()


async def test_many_concurrent_with_preemption_complete() -> None:
    e = MockerEngine({"speedup_ratio": 0, "block_size": 4, "num_gpu_blocks": 40,
                      "max_model_len": 64, "max_num_batched_tokens": 64})
    await e.start()
    try:
        outs = await asyncio.gather(*(collect(e, TokensPrompt([i + 3] * 16), f"r{i}", max_tokens=24,
                                              ignore_eos=True) for i in range(12)))
        for i, o in enumerate(outs):
            assert tokens(o) == predict_output([i + 3] * 16, 24, 32000, ignore_eos=True)
        assert e.stats()[0].active_kv_blocks == 0
    finally:
        await e.shutdown()
