"""The echo actor end to end on a real nats-server: echo, stream, cancel, errors, crash, drain."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping

import pytest

from actors.base import Actor, Endpoint
from actors.echo.actor import EchoActor, EchoCrash
from actors.echo.contract import EchoReply, StreamChunk
from bus import subjects as S
from bus.context import BusContext
from bus.errors import BadRequest, RemoteError, Unavailable
from bus.registry import Registry
from bus.rpc import request, stream_request


@pytest.fixture
async def echo(bus: BusContext) -> AsyncIterator[EchoActor]:
    actor = EchoActor(bus, role="example")
    await actor.start()
    yield actor
    await actor.stop(2.0)


async def eventually(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def test_echo_and_registry_record(bus: BusContext, echo: EchoActor) -> None:
    reply = await request(bus.nc, bus.subjects.echo("echo"), {"message": "hello"}, reply_type=EchoReply)
    assert reply == EchoReply(message="hello", instance=echo.instance)
    reg = Registry(bus.js, bus.subjects.bucket_instances)
    await reg.ensure()
    rec = json.loads(await reg.get(echo.instance) or b"null")
    assert rec["kind"] == "echo" and rec["host"] == "testhost" and rec["role"] == "example"


async def test_stream_chunks_and_instance(bus: BusContext, echo: EchoActor) -> None:
    call = stream_request(bus.nc, bus.subjects.echo("stream"), {"count": 500}, chunk_type=StreamChunk)
    got = [c.index async for c in call]
    assert got == list(range(500)) and call.instance == echo.instance
    assert echo.streams_completed == 1


async def test_stream_error_and_validation(bus: BusContext, echo: EchoActor) -> None:
    got = []
    with pytest.raises(RemoteError) as ei:
        async for c in stream_request(bus.nc, bus.subjects.echo("stream"), {"count": 5, "fail_at": 2}):
            got.append(c)
    assert ei.value.code == 422 and len(got) == 2
    with pytest.raises(BadRequest):  # rejected before streaming starts
        async for _ in stream_request(bus.nc, bus.subjects.echo("stream"), {"count": -1}):
            pass


async def test_cancel_reaches_the_actor(bus: BusContext, echo: EchoActor) -> None:
    call = stream_request(bus.nc, bus.subjects.echo("stream"), {"count": 10_000, "interval": 0.01})
    async for c in call:
        if c[0] == 3:  # array_like chunk decoded without a type: [index, data]
            break
    await call.aclose()
    await eventually(lambda: echo.streams_closed_early == 1)
    assert echo.cancels.cancelled == 1 and echo.chunks_sent < 10_000


async def test_bad_json_is_a_typed_error_and_actor_keeps_serving(bus: BusContext, echo: EchoActor) -> None:
    msg = await bus.nc.request(bus.subjects.echo("echo"), b"{not json", timeout=2)  # like `nats req`
    assert msg.headers[S.SERVICE_ERROR_CODE] == "400"
    assert "malformed JSON" in msg.headers[S.SERVICE_ERROR]
    with pytest.raises(BadRequest, match="message"):
        await request(bus.nc, bus.subjects.echo("echo"), {"message": 5})
    assert (await request(bus.nc, bus.subjects.echo("echo"), {"message": "still"}))["message"] == "still"


class Buggy(Actor):
    kind = "buggy"
    description = "raises unexpected exceptions"

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint("boom", self.bus.subjects.actor("buggy", "all", "boom"), self.boom)]

    async def boom(self, req: dict, headers: Mapping[str, str]) -> dict:  # type: ignore[type-arg]
        if req.get("fail"):
            raise ZeroDivisionError("unexpected")
        return {"ok": True}


async def test_unexpected_exception_is_500_and_actor_survives(bus: BusContext) -> None:
    actor = Buggy(bus, register=False)
    await actor.start()
    try:
        subj = bus.subjects.actor("buggy", "all", "boom")
        with pytest.raises(RemoteError) as ei:
            await request(bus.nc, subj, {"fail": True})
        assert ei.value.code == 500
        assert await request(bus.nc, subj, {}) == {"ok": True}
    finally:
        await actor.stop(1.0)


async def test_crash_fails_wait_and_deregisters(bus: BusContext, echo: EchoActor) -> None:
    reg = Registry(bus.js, bus.subjects.bucket_instances)
    await reg.ensure()
    assert await reg.get(echo.instance) is not None
    reply = await request(bus.nc, bus.subjects.echo("crash"), {"reason": "test"})
    assert reply["status"] == "crashing"
    with pytest.raises(EchoCrash, match="test"):
        await asyncio.wait_for(echo.wait(), 5)
    assert await reg.get(echo.instance) is None
    with pytest.raises(Unavailable):
        await request(bus.nc, bus.subjects.echo("echo"), {"message": "x"})


async def test_crash_needs_an_explicit_object(bus: BusContext, echo: EchoActor) -> None:
    """crash is strict: a stray empty (or malformed, or unknown-field) message does not kill the actor."""
    for body in (b"", b'{"bogus": 1}', b"\xff\xfe", b"[]", b'{"reason": 1}'):
        msg = await bus.nc.request(bus.subjects.echo("crash"), body, timeout=5)
        assert (msg.headers or {}).get(S.SERVICE_ERROR_CODE) == "400", (body, msg.headers)
    reply = await request(bus.nc, bus.subjects.echo("echo"), {"message": "still here"})
    assert reply["instance"] == echo.instance
    assert (await request(bus.nc, bus.subjects.echo("crash"), {}))["status"] == "crashing"  # {}: the default
    with pytest.raises(EchoCrash, match="crash requested"):
        await asyncio.wait_for(echo.wait(), 5)


async def test_stop_drains_in_flight_then_cancels(bus: BusContext) -> None:
    actor = EchoActor(bus, drain_timeout=5.0)
    await actor.start()
    slow = asyncio.create_task(request(bus.nc, bus.subjects.echo("echo"), {"message": "m", "delay": 0.5}))
    await eventually(lambda: actor.in_flight == 1)
    await actor.stop(5.0)
    assert (await slow)["message"] == "m"  # finished during the drain
    await actor.wait()  # a requested stop is a normal exit

    actor = EchoActor(bus, drain_timeout=0.2)
    await actor.start()
    stuck = asyncio.create_task(request(bus.nc, bus.subjects.echo("echo"), {"message": "m", "delay": 30},
                                        timeout=3))
    await eventually(lambda: actor.in_flight == 1)
    await actor.stop(5.0)
    assert actor.in_flight == 0  # cancelled after the bounded drain
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)


async def test_bounded_concurrency(bus: BusContext) -> None:
    actor = EchoActor(bus, max_concurrency=2, register=False)
    await actor.start()
    try:
        reqs = [asyncio.create_task(request(bus.nc, bus.subjects.echo("echo"), {"message": str(i), "delay": 0.3}))
                for i in range(5)]
        await asyncio.sleep(0.15)
        assert actor.in_flight == 2
        assert sorted(r["message"] for r in await asyncio.gather(*reqs)) == [str(i) for i in range(5)]
    finally:
        await actor.stop(1.0)
