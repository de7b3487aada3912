"""Engine-actor logic without NATS: EngineService + SleepController + HealthChecker on the mocker."""

from __future__ import annotations

import asyncio
import base64
import io
import os
from typing import Any

import msgspec
import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import SamplingOptions
from actors.worker.contract import (
    EngineDead,
    EngineLoraAdd,
    GenerateChunk,
    GenerateRequest,
    HealthReply,
    PrefillResult,
    SleepRequest,
)
from actors.worker.health import HealthChecker
from actors.worker.metrics import WorkerMetrics, load_reports
from actors.worker.serving import EngineService
from actors.worker.sleep import SleepController
from actors.worker.validation import context_length_message
from bus.errors import BadRequest, NotFound, Overloaded, Unavailable
from config.topology import HealthConfig, ModelConfig, PoolConfig, SleepConfig

FAST = {"speedup_ratio": "inf", "max_model_len": 256, "enable_lora": True, "max_loras": 2}


def make(pool: PoolConfig | None = None, **args: Any) -> EngineService:
    pool = pool or PoolConfig(engine="mocker")
    eargs = {**FAST, **pool.engine_args, **args}
    return EngineService(lambda: MockerEngine(dict(eargs), role=pool.role), pool,
                         model=ModelConfig(name="m", path="mock"), metrics=WorkerMetrics("i", "m"))


async def collect(svc: EngineService, req: GenerateRequest) -> list[GenerateChunk]:
    return [c async for c in svc.generate(req)]


def req(**kw: Any) -> GenerateRequest:
    sampling = SamplingOptions(max_tokens=kw.pop("max_tokens", 4), ignore_eos=True)
    return GenerateRequest(sampling=sampling, **kw)


@pytest.fixture
async def svc():
    s = make()
    await s.start()
    yield s
    await s.shutdown()


async def test_token_and_text_mode_usage(svc: EngineService) -> None:
    chunks = await collect(svc, req(token_ids=[5, 6, 7], max_tokens=5))
    assert sum(len(c.token_ids) for c in chunks) == 5
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 5)
    assert all(c.usage is None for c in chunks[:-1])
    text = await collect(svc, req(prompt="hello there world", max_tokens=3))
    assert text[-1].usage is not None and text[-1].usage.completion_tokens == 3
    assert "".join(c.text or "" for c in text)


async def test_context_guard_exact_wording(svc: EngineService) -> None:
    with pytest.raises(BadRequest) as ei:
        await collect(svc, req(token_ids=[5] * 250, max_tokens=10))
    assert str(ei.value) == (
        "This model's maximum context length is 256 tokens. However, you requested 260 tokens "
        "(250 in the messages, 10 in the completion). Please reduce the length of the messages or completion.")
    assert str(ei.value) == context_length_message(256, 250, 10)
    # text mode (no tokenizer file for the mocker): caught on the engine's own prompt count
    with pytest.raises(BadRequest, match=r"maximum context length is 256 tokens. However, you requested 1100 "
                                         r"tokens \(1000 in the messages, 100 in the completion\)"):
        await collect(svc, req(prompt="word " * 200, max_tokens=100))
    with pytest.raises(BadRequest, match="maximum context length is 256 tokens"):
        await collect(svc, req(prompt="word " * 20, max_tokens=250))
    assert svc.in_flight() == 0
    assert len(await collect(svc, req(token_ids=[1, 2]))) >= 1  # still serving


@pytest.mark.parametrize("bad", [
    {},  # no prompt
    {"token_ids": [1], "prompt": "x"},  # two prompts
    {"token_ids": []},
    {"token_ids": [-1]},
    {"token_ids": [10**9]},
    {"prompt": ""},
    {"token_ids": [1], "sampling": {"max_tokens": 0}},
    {"token_ids": [1], "sampling": {"top_p": 0}},
    {"prompt_embeds": "AAAA"},  # embeds not enabled for this pool
])
async def test_bad_requests(svc: EngineService, bad: dict[str, Any]) -> None:
    r = msgspec.convert(bad, GenerateRequest)
    with pytest.raises(BadRequest):
        await collect(svc, r)
    assert len(await collect(svc, req(token_ids=[1, 2]))) >= 1


@pytest.mark.parametrize("body,param,words", [
    # what a JSON client of the worker (nats req) can send: JSON integers have no size limit
    (b'{"token_ids":[1],"sampling":{"logprobs":9223372036854775808}}', "logprobs",
     "Requested sample logprobs of 9223372036854775808, which is greater than max allowed: 20"),
    (b'{"token_ids":[1],"sampling":{"logprobs":21}}', "logprobs", "max allowed: 20"),
    (b'{"token_ids":[1],"sampling":{"top_k":18446744073709551617}}', "top_k", "at most the vocabulary size"),
    (b'{"token_ids":[1],"sampling":{"seed":18446744073709551617}}', "seed", "seed must be an integer in"),
    (b'{"token_ids":[1],"sampling":{"max_tokens":18446744073709551617}}', "max_tokens", "at most"),
    (b'{"token_ids":[9223372036854775813]}', "token_ids", "Token id 9223372036854775813 is out of vocabulary"),
    (b'{"token_ids":[1],"sampling":{"stop_token_ids":[32000]}}', "stop_token_ids", "out-of-vocab"),
    (b'{"token_ids":[1],"sampling":{"extra":{"logit_bias":{"99999999999999999999":1}}}}', "logit_bias",
     "out-of-vocab"),
    (b'{"token_ids":[1],"sampling":{"extra":{"prompt_logprobs":100}}}', "prompt_logprobs",
     "Requested prompt logprobs of 100"),
    (b'{"token_ids":[1],"sampling":{"extra":{"allowed_token_ids":[]}}}', "allowed_token_ids", "empty"),
    (b'{"prompt":"x","sampling":{"stop":["' + b"s" * 1025 + b'"]}}', "stop", "at most 1024 characters"),
])
async def test_model_limits_before_the_engine(svc: EngineService, body: bytes, param: str, words: str) -> None:
    r = msgspec.json.decode(body, type=GenerateRequest)
    with pytest.raises(BadRequest) as ei:
        await collect(svc, r)
    assert words in str(ei.value) and getattr(ei.value, "param", None) == param
    assert svc.in_flight() == 0
    assert len(await collect(svc, req(token_ids=[1, 2]))) >= 1


async def test_limits_follow_the_engine_facts() -> None:
    s = make(max_logprobs=40, vocab_size=100)
    await s.start()
    try:
        ok = GenerateRequest(token_ids=[99], sampling=SamplingOptions(max_tokens=1, logprobs=40, top_k=100))
        assert (await collect(s, ok))[-1].finish_reason == "length"
        for sampling in ({"logprobs": 41}, {"top_k": 101}):
            with pytest.raises(BadRequest):
                await collect(s, msgspec.convert({"token_ids": [1], "sampling": sampling}, GenerateRequest))
        with pytest.raises(BadRequest, match="Token id 100 is out of vocabulary"):
            await collect(s, GenerateRequest(token_ids=[100]))
    finally:
        await s.shutdown()


def _embeds(tensor: Any) -> str:
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


async def test_prompt_embeds() -> None:
    import torch

    s = make(PoolConfig(engine="mocker", prompt_embeds=True))
    await s.start()
    try:
        chunks = await collect(s, req(prompt_embeds=_embeds(torch.randn(7, 16)), max_tokens=2))
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 7
        for bad, match in [("not base64!", "base64"),
                           (base64.b64encode(b"garbage").decode(), "torch.save"),
                           (_embeds(torch.randn(2, 7, 16)), "2-D"),
                           (_embeds({"a": torch.randn(2, 2)}), "tensor"),
                           (_embeds(torch.ones(3, 4, dtype=torch.int64)), "floating")]:
            with pytest.raises(BadRequest, match=match):
                await collect(s, req(prompt_embeds=bad))
        with pytest.raises(BadRequest, match="maximum context length"):
            await collect(s, req(prompt_embeds=_embeds(torch.randn(250, 16)), max_tokens=10))
    finally:
        await s.shutdown()


async def test_lora_unknown_is_404_and_known_works(svc: EngineService) -> None:
    with pytest.raises(NotFound):
        await collect(svc, req(token_ids=[1], lora_name="nope"))
    await svc.lora_add(EngineLoraAdd(lora_name="a1", lora_id=1, path="/tmp/a1"))
    assert (await svc.lora_add(EngineLoraAdd(lora_name="a1", lora_id=1, path="/tmp/a1"))).status == "ok"
    assert [a.lora_name for a in svc.lora_list()] == ["a1"]
    assert (await collect(svc, req(token_ids=[1], lora_name="a1")))[-1].finish_reason == "length"
    await svc.lora_remove("a1")
    with pytest.raises(NotFound):
        await collect(svc, req(token_ids=[1], lora_name="a1"))


async def test_admission_guard() -> None:
    s = make(PoolConfig(engine="mocker", max_waiting=1), speedup_ratio=0.05, max_num_seqs=1)
    await s.start()
    try:
        async def until(field: str) -> None:
            for _ in range(500):
                if sum(getattr(st, field) for st in s.engine.stats()) >= 1:
                    return
                await asyncio.sleep(0.01)

        long = [asyncio.create_task(collect(s, req(token_ids=[1, 2, 3], max_tokens=200)))]
        await until("num_running")
        long.append(asyncio.create_task(collect(s, req(token_ids=[1, 2, 3], max_tokens=200))))
        await until("num_waiting")
        with pytest.raises(Overloaded, match="max_waiting=1"):
            await collect(s, req(token_ids=[1]))
        for t in long:
            t.cancel()
        await asyncio.gather(*long, return_exceptions=True)
    finally:
        await s.shutdown()


async def test_prefill_and_decode_roles() -> None:
    p = make(PoolConfig(engine="mocker", role="prefill"))
    d = make(PoolConfig(engine="mocker", role="decode"))
    await p.start()
    await d.start()
    try:
        pc = await collect(p, req(token_ids=list(range(1, 40)), max_tokens=50))
        assert sum(len(c.token_ids) for c in pc) == 1
        last = pc[-1]
        assert last.usage is not None and last.usage.prompt_tokens == 39
        assert last.disaggregated_params is not None and last.disaggregated_params.kv_transfer_params
        kv = last.disaggregated_params.kv_transfer_params
        dc = await collect(d, req(token_ids=list(range(1, 40)), max_tokens=5,
                                  prefill_result=PrefillResult(kv_transfer_params=kv)))
        assert sum(len(c.token_ids) for c in dc) == 5
        eng = d.engine
        assert isinstance(eng, MockerEngine) and eng.received_kv_transfer_params[-1] == kv
    finally:
        await p.shutdown()
        await d.shutdown()


async def test_cancel_and_caller_gone_abort_engine_request() -> None:
    s = make(speedup_ratio=0.2, max_model_len=4096)
    await s.start()
    try:
        gen = s.generate(req(token_ids=[1, 2], max_tokens=500, request_id="r1"))
        await gen.__anext__()
        with pytest.raises(NotFound):
            await s.cancel("other")
        assert (await s.cancel("r1")).status == "ok"
        rest = [c async for c in gen]
        assert rest[-1].finish_reason == "abort"
        # caller gone: the consumer stops iterating mid-stream
        gen2 = s.generate(req(token_ids=[1, 2], max_tokens=500, request_id="r2"))
        await gen2.__anext__()
        await gen2.aclose()
        assert s.in_flight() == 0
        for _ in range(100):
            if sum(st.num_running for st in s.engine.stats()) == 0:
                break
            await asyncio.sleep(0.01)
        assert sum(st.num_running for st in s.engine.stats()) == 0
        body = s.metrics.render()[0].decode()
        assert 'reason="cancel"' in body and 'reason="caller_gone"' in body
    finally:
        await s.shutdown()


async def test_engine_death_ends_streams_with_engine_dead() -> None:
    s = make(speedup_ratio=0.5, max_model_len=4096)
    await s.start()

    async def one(i: int) -> BaseException | None:
        try:
            await collect(s, req(token_ids=[1, 2, i], max_tokens=1000))
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    tasks = [asyncio.create_task(one(i)) for i in range(8)]
    while sum(st.num_running for st in s.engine.stats()) < 8:
        await asyncio.sleep(0.01)
    eng = s.engine
    assert isinstance(eng, MockerEngine)
    eng.inject_death()
    errs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(isinstance(e, EngineDead) and str(e).startswith("engine dead") for e in errs), errs
    with pytest.raises(Overloaded, match="restarting"):  # refused, not a death it coincided with
        await collect(s, req(token_ids=[1]))
    assert (await s.health(1.0)).status == "unhealthy"
    await s.shutdown()


async def test_sleep_deregisters_first_and_gates_generate() -> None:
    s = make()
    await s.start()
    events: list[str] = []
    eng = s.engine
    orig_sleep = eng.sleep

    async def spy_sleep(level: int = 1) -> None:
        events.append(f"engine.sleep({level})")
        await orig_sleep(level)

    eng.sleep = spy_sleep  # type: ignore[method-assign]

    async def dereg() -> None:
        events.append("deregister")

    async def reg() -> None:
        events.append("register")

    sc = SleepController(s, register=reg, deregister=dereg, config=SleepConfig())
    try:
        assert (await sc.wake_up()).message == "already awake"
        r = await sc.sleep(SleepRequest(level=1))
        assert r.status == "ok" and events == ["deregister", "engine.sleep(1)"]
        assert (await sc.sleep(SleepRequest(level=1))).message.startswith("already asleep")
        assert (await s.health(1.0)).status == "sleeping"
        with pytest.raises(Overloaded, match="asleep"):
            await collect(s, req(token_ids=[1]))
        assert (await sc.wake_up()).status == "ok"
        assert events[-1] == "register"
        assert (await collect(s, req(token_ids=[1])))[-1].finish_reason == "length"
        assert (await sc.sleep(SleepRequest(level=7))).status == "error"
    finally:
        await s.shutdown()


async def test_sleep_drain_then_abort_and_idle_autosleep() -> None:
    s = make(speedup_ratio=0.2, max_model_len=20_000)
    await s.start()
    noop = asyncio.sleep
    sc = SleepController(s, register=lambda: noop(0), deregister=lambda: noop(0),
                         config=SleepConfig(idle_timeout=0.3, level=1))
    try:
        task = asyncio.create_task(collect(s, req(token_ids=[1], max_tokens=10_000)))
        while s.in_flight() == 0:
            await asyncio.sleep(0.01)
        r = await sc.sleep(SleepRequest(level=1, mode="drain", drain_timeout=0.2))
        assert r.status == "ok" and "aborted" in r.message
        with pytest.raises(Unavailable, match="going to sleep"):  # typed 503: the frontend migrates it
            await task
        await sc.wake_up()
        sc.start_idle_watch()
        for _ in range(100):
            if sc.asleep:
                break
            await asyncio.sleep(0.05)
        assert sc.asleep and await s.engine.is_sleeping()
        await sc.stop_idle_watch()
    finally:
        await s.shutdown()


async def test_load_reports_from_stats(svc: EngineService) -> None:
    await collect(svc, req(token_ids=list(range(1, 40))))
    reps = load_reports("i", svc.engine.stats(), now=1.0)
    assert len(reps) == 1 and reps[0].instance == "i" and reps[0].total_kv_blocks > 0
    svc.metrics.update_engine(svc.engine.stats())
    assert b'vllm_actors_worker_kv_total_blocks{dp_rank="0"' in svc.metrics.render()[0]


# --- health checker logic ----------------------------------------------------------------------------
async def test_health_checker_escalates_on_hang_and_death() -> None:
    s = make(speedup_ratio="inf")
    await s.start()
    escalations: list[str] = []

    async def probe(deadline: float) -> None:
        async def one() -> None:
            async for c in s.generate(req(token_ids=[1], max_tokens=1)):
                if c.finish_reason:
                    return
        await asyncio.wait_for(one(), deadline)

    async def check() -> HealthReply:
        return await s.health(1.0)

    async def escalate(reason: str) -> None:
        escalations.append(reason)

    hc = HealthChecker(check, probe, escalate, HealthConfig(interval=0.05, timeout=0.3))
    try:
        await hc.tick()
        assert hc.state == "ok" and hc.ready and not escalations
        eng = s.engine
        assert isinstance(eng, MockerEngine)
        eng.inject_hang()  # check_health still passes: only the probe can tell
        assert (await s.health(1.0)).status == "healthy"
        await hc.tick()
        assert len(escalations) == 1 and "hung" in escalations[0]
        await hc.tick()
        assert len(escalations) == 1  # one failure, one escalation
        eng.clear_hang()
        await hc.tick()
        assert hc.state == "ok"
        eng.inject_death()
        await hc.tick()
        assert len(escalations) == 1  # first sighting: the engine actor fails itself
        await hc.tick()
        assert len(escalations) == 2 and "dead" in escalations[1]
    finally:
        await s.shutdown()


async def test_health_checker_uses_traffic_as_liveness() -> None:
    s = make(speedup_ratio=0.2, max_model_len=100_000)
    await s.start()
    probes: list[float] = []
    escalations: list[str] = []

    async def probe(deadline: float) -> None:
        probes.append(deadline)

    async def escalate(reason: str) -> None:
        escalations.append(reason)

    hc = HealthChecker(lambda: s.health(1.0), probe, escalate, HealthConfig(interval=0.05, timeout=0.3))
    task = asyncio.create_task(collect(s, req(token_ids=[1], max_tokens=50_000)))
    try:
        while s.in_flight() == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await hc.tick()
        assert hc.state == "ok" and probes == [] and escalations == []  # traffic flows: no probe
        eng = s.engine
        assert isinstance(eng, MockerEngine)
        eng.inject_hang()
        await asyncio.sleep(0.4)
        await hc.tick()
        assert len(escalations) == 1 and "produced nothing" in escalations[0]
        eng.clear_hang()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await s.shutdown()


def test_engine_env_spreads_cores_and_nixl_ports() -> None:
    from actors.worker.engine_factory import engine_env
    from actors.worker.process import cpu_slot
    from config.loader import topology_from_dict

    t = topology_from_dict({"model": {"name": "m", "path": "tiny"}, "pools": {
        "prefill": {"role": "prefill", "replicas": 2, "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}},
        "decode": {"role": "decode", "replicas": 1, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}}})
    assert [cpu_slot(t, "prefill", 0), cpu_slot(t, "prefill", 1), cpu_slot(t, "decode", 0)] == [0, 1, 2]
    # a host's only vLLM engine is not pinned (vllm serve's way; pinned to core 0 it lost 17 % of
    # its throughput to the frontend beside it); a mocker pool has no EngineCore to pin
    alone = topology_from_dict({"model": {"name": "m", "path": "tiny"}, "pools": {
        "agg": {"role": "agg", "replicas": 1}, "mock": {"role": "agg", "engine": "mocker", "replicas": 3}}})
    assert cpu_slot(alone, "agg", 0) is None and cpu_slot(alone, "mock", 0) is None
    assert cpu_slot(alone, "agg", 1) == 1  # a second replica the planner spawned later is pinned
    e1 = engine_env(t.pools["prefill"], 1, 1)
    assert e1["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5608" and e1["VLLM_CPU_OMP_THREADS_BIND"] == str(1 % os.cpu_count())
    assert engine_env(t.pools["prefill"], 0, 0)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert engine_env(t.pools["decode"], 0, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "1"  # the topology's choice wins


async def test_only_an_encode_worker_encodes(svc: EngineService) -> None:
    """E/P/D's encode verb on an agg worker is refused by the service, and an engine that is not an
    encode engine refuses it too (the protocol's default); encode workers themselves are covered on
    vLLM (tests/worker/test_encode_worker_vllm.py: the mocker has no vision encoder)."""
    from actors.engines.protocol import ImageInput, MultiModalInput
    from actors.worker.contract import EncodeRequest

    mm = MultiModalInput(images=[ImageInput(uuid="a" * 64, data=b"x")], source_ids=[1, 2], prompt_len=4,
                         placeholders=[(1, 2)])
    with pytest.raises(BadRequest, match="not an encode worker \\(its pool's role is 'agg'\\)"):
        await svc.encode(EncodeRequest(request_id="e", token_ids=[1, 2, 3, 4], mm=mm))
    with pytest.raises(BadRequest, match="this worker is not an encode worker"):
        await svc.engine.encode(mm, [1, 2, 3, 4], "e")
    with pytest.raises(BadRequest, match="this worker is not an encode worker"):
        await svc.engine.encode_probe("p")
