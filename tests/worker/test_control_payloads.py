"""Strict control payloads over a real nats-server with the mocker engine and a LoRA manager.

The verbs that change state (sleep, wake_up, clear_kv_blocks, lora.load, lora.unload, and the
engine-side engine.lora_add|remove) are sent raw bytes without headers, exactly what
``nats req <subject> '<payload>'`` sends. An empty, malformed, non-object, unknown-field, wrongly
typed or invalid-UTF-8 payload must come back as a 400 (``Nats-Service-Error-Code``) with a message
that says what is wrong, and must change nothing. ``{}`` (and ``{"level": 1}``) still work.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.base import Endpoint, strict_struct
from actors.worker import contract as C
from actors.worker.contract import GenerateChunk
from actors.worker.engine_actor import EngineActor
from actors.worker.lora_actor import LoraActor
from bus import subjects as S
from bus.context import BusContext
from bus.registry import Registry
from bus.stream import stream_request
from config.topology import LoraConfig
from tests.worker.test_engine_actor import actor_for, gen_req

# Refused by every strict verb, whatever its fields: (payload, what the error message must say).
COMMON_BAD: list[tuple[bytes, str]] = [
    (b"", "needs a JSON object (send '{}'"),
    (b'{"bogus": 1}', "unknown field `bogus`"),
    (b"\xff\xfe", "malformed JSON payload"),
    (b"[]", "Expected `object`, got `array`"),
    (b"not json", "malformed JSON payload"),
    (b"1", "Expected `object`, got `int`"),
    (b'"x"', "Expected `object`, got `str`"),
    (b"null", "Expected `object`, got `null`"),
    (b'{"\xff": 1}', "invalid UTF-8"),  # UnicodeDecodeError before msgspec 0.23 (was a 500), DecodeError since
]
SLEEP_BAD = COMMON_BAD + [
    (b'{"level": "x"}', "Expected `int`, got `str` - at `$.level`"),
    (b'{"mode": "sideways"}', "Invalid enum value 'sideways' - at `$.mode`"),
    (b'{"mode": "\xff"}', "invalid UTF-8"),
    (b'{"levle": 2}', "unknown field `levle`"),
]
LORA_LOAD_BAD = COMMON_BAD + [
    (b'{"lora_name": "a1"}', "missing required field `source`"),
    (b'{"lora_name": "a1", "source": {"uri": "URI", "sha": "x"}}', "unknown field `sha` - at `$.source`"),
    (b'{"lora_name": 1, "source": {"uri": "URI"}}', "Expected `str`, got `int` - at `$.lora_name`"),
    (b'{"lora_name": "\xff", "source": {"uri": "URI"}}', "invalid UTF-8"),
]
LORA_UNLOAD_BAD = COMMON_BAD + [(b'{"lora_name": ["a1"]}', "Expected `str`, got `array`")]


@pytest.fixture
async def worker(bus: BusContext) -> AsyncIterator[EngineActor]:
    a = actor_for(bus)
    await a.start()
    yield a
    await a.stop(2.0)


@pytest.fixture
async def lora(bus: BusContext, worker: EngineActor, adapter_root: Path, tmp_path: Path) -> AsyncIterator[LoraActor]:
    a = LoraActor(bus.child(), worker_instance=worker.instance, pool_name="p0", model="mock-model", role="agg",
                  config=LoraConfig(roots=[str(adapter_root)]), max_loras=2, cache_dir=str(tmp_path / "cache"))
    await a.start()
    yield a
    await a.stop(2.0)


async def raw(bus: BusContext, verb: str, body: bytes, instance: str = "w1") -> tuple[Any, dict[str, str]]:
    """Plain bytes, no headers: what `nats req` sends."""
    msg = await bus.nc.request(bus.subjects.worker(instance, verb), body, timeout=5)
    return (json.loads(msg.data) if msg.data else None), dict(msg.headers or {})


async def ok(bus: BusContext, verb: str, body: bytes) -> Any:
    reply, hdr = await raw(bus, verb, body)
    assert S.SERVICE_ERROR_CODE not in hdr, (verb, body, hdr)
    return reply


async def assert_refused(bus: BusContext, verb: str, bad: list[tuple[bytes, str]],
                         unchanged: Callable[[], Awaitable[None]], uri: str = "") -> None:
    for body, expect in bad:
        body = body.replace(b"URI", uri.encode())
        _, hdr = await raw(bus, verb, body)
        assert hdr.get(S.SERVICE_ERROR_CODE) == "400", (verb, body, hdr)
        assert expect in hdr.get(S.SERVICE_ERROR, ""), (verb, body, hdr)
        await unchanged()


async def registry_status(bus: BusContext, instance: str = "w1") -> str | None:
    """The status the instance's registry record says (None: no record)."""
    reg = Registry(bus.js, bus.subjects.bucket_instances)
    await reg.ensure()
    data = await reg.get(instance)
    return None if data is None else json.loads(data).get("status", "ready")  # omitted: the default


async def registered(bus: BusContext, instance: str = "w1") -> bool:
    """Registered as routable: a sleeping worker keeps its record, as "sleeping", and routers skip it."""
    return await registry_status(bus, instance) == "ready"


async def health(bus: BusContext) -> str:
    return (await ok(bus, C.VERB_HEALTH, b""))["status"]  # read-only verbs still take an empty payload


async def cached_tokens(bus: BusContext, prompt: list[int]) -> int:
    chunks = [c async for c in stream_request(bus.nc, bus.subjects.generate("p0"), gen_req(token_ids=prompt),
                                              msgpack=True, chunk_type=GenerateChunk, stall_timeout=5)]
    usage = chunks[-1].usage
    assert usage is not None
    return usage.cached_tokens


# --- engine actor --------------------------------------------------------------------------------
async def test_sleep_refuses_bad_payloads_and_stays_awake(bus: BusContext, worker: EngineActor) -> None:
    slept: list[int] = []
    engine_sleep = worker.service.engine.sleep

    async def spy(level: int = 1) -> None:
        slept.append(level)
        await engine_sleep(level)

    worker.service.engine.sleep = spy  # type: ignore[method-assign]

    async def awake_and_registered() -> None:
        assert await health(bus) == "healthy"
        assert await registered(bus) and worker.service.accepting and slept == []

    await assert_refused(bus, C.VERB_SLEEP, SLEEP_BAD, awake_and_registered)
    # the valid forms still work
    assert (await ok(bus, C.VERB_SLEEP, b'{"level":1}'))["message"] == "asleep at level 1"
    assert await health(bus) == "sleeping" and not await registered(bus) and slept == [1]
    assert await registry_status(bus) == "sleeping"  # out of routing, still seen by readiness and wakers
    assert (await ok(bus, C.VERB_WAKE_UP, b"{}"))["message"] == "awake"
    assert (await ok(bus, C.VERB_SLEEP, b"{}"))["message"] == "asleep at level 1"  # {}: the defaults
    assert slept == [1, 1]


async def test_wake_up_refuses_bad_payloads_and_stays_asleep(bus: BusContext, worker: EngineActor) -> None:
    assert (await ok(bus, C.VERB_SLEEP, b'{"level": 1}'))["status"] == "ok"

    async def still_asleep() -> None:
        assert await health(bus) == "sleeping"
        assert not await registered(bus) and not worker.service.accepting

    await assert_refused(bus, C.VERB_WAKE_UP, COMMON_BAD, still_asleep)
    assert await ok(bus, C.VERB_WAKE_UP, b"{}") == {"status": "ok", "message": "awake"}
    assert await health(bus) == "healthy" and await registered(bus)


async def test_clear_kv_blocks_refuses_bad_payloads_and_keeps_the_cache(bus: BusContext,
                                                                      worker: EngineActor) -> None:
    prompt = list(range(100, 164))  # 4 full blocks of 16
    await cached_tokens(bus, prompt)
    assert await cached_tokens(bus, prompt) > 0  # the prefix cache serves the repeat

    async def cache_kept() -> None:
        assert await cached_tokens(bus, prompt) > 0
        assert await health(bus) == "healthy"

    await assert_refused(bus, C.VERB_CLEAR_KV_BLOCKS, COMMON_BAD, cache_kept)
    assert (await ok(bus, C.VERB_CLEAR_KV_BLOCKS, b"{}"))["status"] == "ok"
    assert await cached_tokens(bus, prompt) == 0  # cleared: nothing cached any more


async def test_engine_lora_verbs_are_strict(bus: BusContext, worker: EngineActor) -> None:
    async def none_loaded() -> None:
        assert (await ok(bus, C.ENGINE_LORA_LIST, b""))["adapters"] == []

    await assert_refused(bus, C.ENGINE_LORA_ADD, COMMON_BAD + [
        (b'{"lora_name": "a1", "lora_id": "1", "path": "/tmp/a1"}', "Expected `int`, got `str` - at `$.lora_id`"),
        (b'{"lora_name": "a1", "lora_id": 1, "path": "/tmp/a1", "x": 0}', "unknown field `x`")], none_loaded)
    await ok(bus, C.ENGINE_LORA_ADD, b'{"lora_name": "a1", "lora_id": 1, "path": "/tmp/a1"}')

    async def still_loaded() -> None:
        assert [a["lora_name"] for a in (await ok(bus, C.ENGINE_LORA_LIST, b"{}"))["adapters"]] == ["a1"]

    await assert_refused(bus, C.ENGINE_LORA_REMOVE, COMMON_BAD, still_loaded)
    await ok(bus, C.ENGINE_LORA_REMOVE, b'{"lora_name": "a1"}')
    await none_loaded()


async def test_cancel_json_form_is_strict(bus: BusContext, worker: EngineActor) -> None:
    for body, expect in ((b'{"request_id": "r1", "bogus": 1}', "unknown field `bogus`"),
                         (b'{"request_id": 5}', "Expected `str`, got `int`"),
                         (b'{"request_id": "\xff"}', "invalid UTF-8"),
                         (b"\xff\xfe", "not valid UTF-8"),
                         (b"", "cancel needs a request_id")):
        _, hdr = await raw(bus, C.VERB_CANCEL, body)
        assert hdr.get(S.SERVICE_ERROR_CODE) == "400" and expect in hdr[S.SERVICE_ERROR], (body, hdr)
    _, hdr = await raw(bus, C.VERB_CANCEL, b'{"request_id": "nope"}')  # well formed: not found
    assert hdr[S.SERVICE_ERROR_CODE] == "404"


# --- LoRA manager --------------------------------------------------------------------------------
async def test_lora_load_refuses_bad_payloads_and_loads_nothing(bus: BusContext, lora: LoraActor,
                                                                adapter_root: Path) -> None:
    uri = f"file://{adapter_root}/a1"

    async def nothing_loaded() -> None:
        assert (await ok(bus, "lora.list", b""))["adapters"] == []  # read-only: empty payload is fine
        assert (await ok(bus, C.ENGINE_LORA_LIST, b""))["adapters"] == []
        loras = Registry(bus.js, bus.subjects.bucket_loras)
        await loras.ensure()
        assert await loras.keys() == []

    await assert_refused(bus, "lora.load", LORA_LOAD_BAD, nothing_loaded, uri=uri)
    reply = await ok(bus, "lora.load", json.dumps({"lora_name": "a1", "source": {"uri": uri}}).encode())
    assert reply["status"] == "ok" and reply["lora_name"] == "a1"
    assert [a["lora_name"] for a in (await ok(bus, "lora.list", b"{}"))["adapters"]] == ["a1"]


async def test_lora_unload_refuses_bad_payloads_and_keeps_the_adapter(bus: BusContext, lora: LoraActor,
                                                                      adapter_root: Path) -> None:
    await ok(bus, "lora.load", json.dumps({"lora_name": "a1", "source": {"uri": f"file://{adapter_root}/a1"}})
             .encode())

    async def still_loaded() -> None:
        assert [a["lora_name"] for a in (await ok(bus, "lora.list", b""))["adapters"]] == ["a1"]
        assert [a["lora_name"] for a in (await ok(bus, C.ENGINE_LORA_LIST, b""))["adapters"]] == ["a1"]

    await assert_refused(bus, "lora.unload", LORA_UNLOAD_BAD, still_loaded)
    assert (await ok(bus, "lora.unload", b'{"lora_name": "a1"}'))["message"] == "adapter a1 unloaded"
    assert (await ok(bus, "lora.list", b"{}"))["adapters"] == []


# --- declarations --------------------------------------------------------------------------------
MUTATING = {"sleep", "wake_up", "clear_kv_blocks", "lora_add", "lora_remove", "lora_load", "lora_unload"}
READ_ONLY = {"health", "stats", "lora_list", "kv_sources"}


async def test_every_mutating_worker_endpoint_is_strict(bus: BusContext, tmp_path: Path) -> None:
    eps = {e.name: e for e in actor_for(bus).endpoints()}
    eps.update({e.name: e for e in LoraActor(bus, worker_instance="w1", pool_name="p0", model="m", role="agg",
                                             config=LoraConfig(), max_loras=1,
                                             cache_dir=str(tmp_path)).endpoints()})
    for name in MUTATING:
        assert not eps[name].allow_empty and strict_struct(eps[name].request_type), name
    for name in READ_ONLY:
        assert eps[name].allow_empty, name
    assert strict_struct(C.CancelRequest) and strict_struct(C.LoraSource)


def test_a_strict_endpoint_needs_a_strict_struct() -> None:
    class Loose(msgspec.Struct):
        x: int = 0

    async def h(req: Any, headers: Any) -> None:
        return None

    for bad in (None, Loose, dict):
        with pytest.raises(TypeError, match="forbid_unknown_fields"):
            Endpoint("x", "s.x", h, bad, allow_empty=False)
    Endpoint("x", "s.x", h, C.WakeUpRequest, allow_empty=False)
    Endpoint("x", "s.x", h, None)  # allow_empty=True: any JSON value, as before
