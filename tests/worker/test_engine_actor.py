"""EngineActor over a real nats-server with the mocker: control surface (header-less JSON, as `nats req`
sends it), streaming, bad requests, cancel, engine death + restart, sleep/wake ordering, load reports."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import SamplingOptions
from actors.instances.contract import InstanceRecord, ModelCard
from actors.worker import contract as C
from actors.worker.contract import (
    EngineDead,
    GenerateChunk,
    GenerateRequest,
    LoadReport,
)
from actors.worker.engine_actor import EngineActor
from bus import subjects as S
from bus.context import BusContext
from bus.errors import BadRequest, NotFound, Overloaded, Unavailable
from bus.registry import Registry
from bus.stream import stream_request
from config.topology import ModelConfig, PoolConfig
from supervisors.child import ChildSpec
from supervisors.supervisor import Supervisor

ARGS = {"speedup_ratio": "inf", "max_model_len": 512, "enable_lora": True, "max_loras": 2, "block_size": 16}
MODEL = ModelConfig(name="mock-model", path="mock")


def actor_for(bus: BusContext, pool: PoolConfig | None = None, instance: str = "w1",
              engines: list[MockerEngine] | None = None, **args: Any) -> EngineActor:
    pool = pool or PoolConfig(engine="mocker")
    eargs = {**ARGS, **pool.engine_args, **args}

    def factory() -> MockerEngine:
        e = MockerEngine(dict(eargs), role=pool.role, served_model_name=MODEL.name)
        if engines is not None:
            engines.append(e)
        return e

    return EngineActor(bus.child(), pool_name="p0", pool=pool, model=MODEL, engine_factory=factory,
                       instance=instance, load_interval=0.1)


@pytest.fixture
async def actor(bus: BusContext) -> AsyncIterator[EngineActor]:
    a = actor_for(bus)
    await a.start()
    yield a
    await a.stop(2.0)


async def jreq(bus: BusContext, verb: str, body: bytes = b"", instance: str = "w1") -> tuple[Any, dict[str, str]]:
    """Header-less JSON request, exactly what `nats req <subject> '<json>'` sends."""
    msg = await bus.nc.request(bus.subjects.worker(instance, verb), body, timeout=5)
    h = msg.headers or {}
    return (json.loads(msg.data) if msg.data else None), h


def gen_req(**kw: Any) -> GenerateRequest:
    return GenerateRequest(sampling=SamplingOptions(max_tokens=kw.pop("max_tokens", 4), ignore_eos=True), **kw)


async def stream(bus: BusContext, payload: Any, subject: str | None = None, msgpack: bool = True) -> list[GenerateChunk]:
    subject = subject or bus.subjects.generate("p0")
    return [c async for c in stream_request(bus.nc, subject, payload, msgpack=msgpack, chunk_type=GenerateChunk,
                                            stall_timeout=5)]


async def test_control_surface_header_less_json(bus: BusContext, actor: EngineActor) -> None:
    h, hdr = await jreq(bus, "health")
    assert h["status"] == "healthy" and h["instance"] == "w1" and h["role"] == "agg" and h["model"] == "mock-model"
    st, _ = await jreq(bus, "stats")
    assert st["pool"] == "p0" and st["accepting"] is True
    assert (await jreq(bus, "clear_kv_blocks", b"{}"))[0]["status"] == "ok"
    assert (await jreq(bus, "wake_up", b"{}"))[0] == {"status": "ok", "message": "already awake"}
    assert (await jreq(bus, "sleep", b'{"level": 1}'))[0]["status"] == "ok"
    assert (await jreq(bus, "sleep", b"{}"))[0]["message"].startswith("already asleep")
    assert (await jreq(bus, "health"))[0]["status"] == "sleeping"
    assert (await jreq(bus, "wake_up", b"{}"))[0] == {"status": "ok", "message": "awake"}
    assert (await jreq(bus, "engine.lora_list"))[0] == {"adapters": []}
    kv = (await jreq(bus, "engine.kv_sources"))[0]
    assert kv["block_size"] == 16 and kv["sources"][0]["endpoint"].startswith("tcp://")
    add = b'{"lora_name": "a1", "lora_id": 1, "path": "/tmp/a1"}'
    assert (await jreq(bus, "engine.lora_add", add))[0]["status"] == "ok"
    assert (await jreq(bus, "engine.lora_list"))[0]["adapters"][0]["lora_name"] == "a1"
    assert (await jreq(bus, "engine.lora_remove", b'{"lora_name": "a1"}'))[0]["status"] == "ok"
    _, hdr = await jreq(bus, "engine.lora_remove", b'{"lora_name": "a1"}')
    assert hdr[S.SERVICE_ERROR_CODE] == "404"
    _, hdr = await jreq(bus, "cancel", b'{"request_id": "nope"}')
    assert hdr[S.SERVICE_ERROR_CODE] == "404"
    _, hdr = await jreq(bus, "sleep", b'{"level": "deep"}')
    assert hdr[S.SERVICE_ERROR_CODE] == "400"
    # registry: the instance record and the model card
    inst = Registry(bus.js, bus.subjects.bucket_instances)
    await inst.ensure()
    rec = msgspec.json.decode(await inst.get("w1") or b"", type=InstanceRecord)
    assert (rec.kind, rec.role, rec.model, rec.pool, rec.block_size) == ("engine", "agg", "mock-model", "p0", 16)
    assert rec.generate_subject == bus.subjects.generate_instance("p0", "w1") and rec.pid > 0 and rec.host
    models = Registry(bus.js, bus.subjects.bucket_models)
    await models.ensure()
    card = msgspec.json.decode(await models.get("mock-model.p0") or b"", type=ModelCard)
    assert (card.context_length, card.kv_block_size, card.role) == (512, 16, "agg")
    # micro service: nats micro info
    info = json.loads((await bus.nc.request("$SRV.INFO.engine", b"", timeout=2)).data)
    assert {"generate", "generate_instance", "sleep", "health", "cancel"} <= {e["name"] for e in info["endpoints"]}
    assert info["metadata"]["instance"] == "w1" and info["metadata"]["pool"] == "p0"


async def test_generate_token_and_text_modes(bus: BusContext, actor: EngineActor) -> None:
    chunks = await stream(bus, gen_req(token_ids=[3, 4, 5], max_tokens=6))
    assert sum(len(c.token_ids) for c in chunks) == 6
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 3
    # text mode, JSON encoding, routed subject
    text = await stream(bus, {"prompt": "hello world", "sampling": {"max_tokens": 3, "ignore_eos": True}},
                        subject=bus.subjects.generate_instance("p0", "w1"), msgpack=False)
    assert text[-1].finish_reason == "length" and text[-1].usage is not None
    assert "".join(c.text or "" for c in text)


@pytest.mark.parametrize("payload,code", [
    (b"{not json", "400"),
    (b'{"token_ids": "abc"}', "400"),
    (b'{"token_ids": [1], "sampling": {"max_tokens": "many"}}', "400"),
    (json.dumps({"token_ids": [1] * 500, "sampling": {"max_tokens": 100}}).encode(), "400"),
    (b'{"prompt_embeds": "!!!not-base64"}', "400"),
    (b'{"token_ids": [1], "lora_name": "ghost"}', "404"),
])
async def test_bad_requests_get_typed_errors(bus: BusContext, actor: EngineActor, payload: bytes, code: str) -> None:
    msg = await bus.nc.request(bus.subjects.generate("p0"), payload, timeout=5)
    assert (msg.headers or {}).get(S.SERVICE_ERROR_CODE) == code, msg.headers
    if payload.startswith(b'{"token_ids": [1, 1'):
        assert "maximum context length is 512 tokens" in msg.headers[S.SERVICE_ERROR]
    assert (await stream(bus, gen_req(token_ids=[1, 2])))[-1].finish_reason == "length"  # still serving


async def test_bad_prompt_embeds_when_enabled(bus: BusContext) -> None:
    import torch

    a = actor_for(bus, PoolConfig(engine="mocker", prompt_embeds=True), instance="we")
    await a.start()
    try:
        for data in ["not base64!", base64.b64encode(b"junk").decode()]:
            with pytest.raises(BadRequest):
                await stream(bus, gen_req(prompt_embeds=data))
        buf = io.BytesIO()
        torch.save(torch.randn(5, 8), buf)
        ok = await stream(bus, gen_req(prompt_embeds=base64.b64encode(buf.getvalue()).decode(), max_tokens=2))
        assert ok[-1].usage is not None and ok[-1].usage.prompt_tokens == 5
    finally:
        await a.stop(2.0)


async def test_cancel_cli_and_caller_stop(bus: BusContext) -> None:
    engines: list[MockerEngine] = []
    a = actor_for(bus, engines=engines, speedup_ratio=0.2, max_model_len=100_000)
    await a.start()
    try:
        # CLI cancel by engine request id: the stream ends with finish_reason "abort"
        call = stream_request(bus.nc, bus.subjects.generate("p0"), gen_req(token_ids=[1], max_tokens=50_000,
                              request_id="r-cli"), chunk_type=GenerateChunk, stall_timeout=5)
        first = await call.__anext__()
        assert first.token_ids
        reply, hdr = await jreq(bus, "cancel", b'{"request_id": "r-cli"}')
        assert reply["status"] == "ok", hdr
        rest = [c async for c in call]
        assert rest[-1].finish_reason == "abort"
        # the caller stops reading: its cancel reaches the worker, the engine request is aborted
        call2 = stream_request(bus.nc, bus.subjects.generate("p0"), gen_req(token_ids=[1], max_tokens=50_000),
                               chunk_type=GenerateChunk, stall_timeout=5)
        await call2.__anext__()
        await call2.aclose()
        for _ in range(200):
            if a.service.in_flight() == 0 and engines[0].stats()[0].num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert a.service.in_flight() == 0 and engines[0].stats()[0].num_running == 0
        body = a.metrics.render()[0].decode()
        assert body.count('reason="cancel"') >= 1
    finally:
        await a.stop(2.0)


async def test_engine_death_restarts_in_place(bus: BusContext) -> None:
    engines: list[MockerEngine] = []
    actors: list[EngineActor] = []

    def start() -> EngineActor:
        a = actor_for(bus, engines=engines, instance="wd", speedup_ratio=0.5, max_model_len=100_000)
        actors.append(a)
        return a

    sup = Supervisor("worker-wd", [ChildSpec(id="engine", start=start)], strategy="rest_for_one",
                     backoff={"initial": 0.05, "max": 0.2, "jitter": 0.0})
    await sup.start()
    inst = Registry(bus.js, bus.subjects.bucket_instances)
    await inst.ensure()
    try:
        async def one(i: int) -> BaseException | None:
            try:
                await stream(bus, gen_req(token_ids=[1, i + 2], max_tokens=50_000))
            except BaseException as e:  # noqa: BLE001
                return e
            return None

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        for _ in range(500):
            if actors[0].service.in_flight() == 8:
                break
            await asyncio.sleep(0.01)
        assert actors[0].service.in_flight() == 8, [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.1)  # every stream has tokens flowing
        engines[0].inject_death()
        errs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(isinstance(e, EngineDead) for e in errs), errs
        for _ in range(300):  # restarted in place: a new engine, same instance, registered again
            if len(engines) == 2 and await inst.get("wd") is not None and actors[-1].service.accepting:
                break
            await asyncio.sleep(0.02)
        assert len(engines) == 2 and not engines[1].dead.is_set()
        assert await inst.get("wd") is not None
        chunks = await stream(bus, gen_req(token_ids=[7, 8], max_tokens=3),
                              subject=bus.subjects.generate_instance("p0", "wd"))
        assert chunks[-1].finish_reason == "length"
        assert sup.children()[0]["restarts"] == 1
    finally:
        await sup.stop(5.0)


async def test_sleep_leaves_routing_first_and_blocks_generate(bus: BusContext) -> None:
    """Sleep takes the worker out of routing before the engine sleeps: its record says "sleeping"
    (routers route "ready" records only) and its generate subjects are gone; wake_up brings both back."""
    engines: list[MockerEngine] = []
    a = actor_for(bus, engines=engines, instance="ws")
    await a.start()
    inst = Registry(bus.js, bus.subjects.bucket_instances)
    await inst.ensure()
    eng = engines[0]
    seen: dict[str, Any] = {}
    orig_sleep, orig_generate = eng.sleep, eng.generate
    generate_calls: list[str] = []

    async def status() -> str | None:
        data = await inst.get("ws")
        return None if data is None else json.loads(data).get("status", "ready")  # omitted: the default

    async def spy_sleep(level: int = 1) -> None:
        seen["status_when_engine_slept"] = await status()
        await orig_sleep(level)

    def spy_generate(*args: Any, **kw: Any) -> Any:
        generate_calls.append("asleep" if seen.get("asleep") else "awake")
        return orig_generate(*args, **kw)

    eng.sleep = spy_sleep  # type: ignore[method-assign]
    eng.generate = spy_generate  # type: ignore[method-assign]
    try:
        await stream(bus, gen_req(token_ids=[1]))
        reply, _ = await jreq(bus, "sleep", b'{"level": 1}', instance="ws")
        assert reply["status"] == "ok"
        seen["asleep"] = True
        assert seen["status_when_engine_slept"] == "sleeping"
        assert await status() == "sleeping"
        for subject in (bus.subjects.generate("p0"), bus.subjects.generate_instance("p0", "ws")):
            with pytest.raises(Unavailable):
                await stream(bus, gen_req(token_ids=[1]), subject=subject)
        assert (await jreq(bus, "health", instance="ws"))[0]["status"] == "sleeping"
        reply, _ = await jreq(bus, "wake_up", b"{}", instance="ws")
        assert reply["status"] == "ok"
        seen["asleep"] = False
        assert await status() == "ready"
        assert (await stream(bus, gen_req(token_ids=[1])))[-1].finish_reason == "length"
        assert "asleep" not in generate_calls and len(generate_calls) == 2
    finally:
        await a.stop(2.0)


async def test_load_reports_published(bus: BusContext, actor: EngineActor) -> None:
    sub = await bus.nc.subscribe(bus.subjects.load("w1"))
    await stream(bus, gen_req(token_ids=list(range(1, 40))))
    msg = await sub.next_msg(timeout=3)
    assert msg.headers and msg.headers.get(S.CONTENT_TYPE) == S.CT_MSGPACK
    rep = msgspec.msgpack.decode(msg.data, type=LoadReport)
    assert rep.instance == "w1" and rep.total_kv_blocks > 0
    await sub.unsubscribe()


async def test_verbs_are_contract_constants() -> None:
    assert {C.VERB_SLEEP, C.VERB_WAKE_UP, C.VERB_HEALTH, C.VERB_CANCEL} == {"sleep", "wake_up", "health", "cancel"}
    with pytest.raises(NotFound):
        raise NotFound("x")


async def test_shutdown_aborts_in_flight_with_typed_error(bus: BusContext) -> None:
    engines: list[MockerEngine] = []
    a = actor_for(bus, engines=engines, instance="wq", speedup_ratio=0.2, max_model_len=100_000)
    await a.start()
    call = stream_request(bus.nc, bus.subjects.generate("p0"), gen_req(token_ids=[1], max_tokens=50_000),
                          chunk_type=GenerateChunk, stall_timeout=5)
    await call.__anext__()
    stopper = asyncio.create_task(a.stop(1.0))
    with pytest.raises(Overloaded, match="shutting down"):  # 503 on the caller side
        async for _ in call:
            pass
    await stopper
    assert 'reason="shutdown"' in a.metrics.render()[0].decode()
    assert engines[0].stats() == [] or engines[0].stats()[0].num_running == 0


async def test_registers_only_after_the_engine_answered_its_probe(bus: BusContext) -> None:
    """Ready means serving: an engine that hangs (check_health still passes) never reaches the
    registry; its start fails so the supervisor retries it. A healthy one is registered only after
    a token came back through its own generate subject."""
    from config.topology import HealthConfig

    pool = PoolConfig(engine="mocker", health=HealthConfig(timeout=1.0))

    def hung_engine() -> MockerEngine:
        e = MockerEngine(dict(ARGS), role=pool.role, served_model_name=MODEL.name)
        e.inject_hang()  # streams stall; check_health still passes
        return e

    hung = EngineActor(bus.child(), pool_name="p0", pool=pool, model=MODEL, engine_factory=hung_engine,
                       instance="hung")
    with pytest.raises(EngineDead, match="no token"):
        await hung.start()
    reg = Registry(bus.js, bus.subjects.bucket_instances)
    await reg.ensure()
    assert await reg.get("hung") is None

    engines: list[MockerEngine] = []
    ok = actor_for(bus, pool, instance="ok", engines=engines)
    await ok.start()
    try:
        assert await reg.get("ok") is not None
        assert engines[0].tokens_generated >= 1  # the probe really ran on the engine
    finally:
        await ok.stop(2.0)
