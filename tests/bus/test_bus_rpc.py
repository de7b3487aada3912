"""Unary request/reply, typed errors, embedded server helpers and connection options."""

from __future__ import annotations

import msgspec
import pytest

from actors.worker.contract import EngineDead
from bus import codec
from bus.connection import RECONNECT, connect_options
from bus.context import BusContext
from bus.embedded import nats_server_binary
from bus.errors import BadRequest, NotFound, Overloaded, RemoteError, RequestTimeout, Unavailable
from bus.rpc import request, respond
from config.topology import BusAuth, BusConfig


class Ping(msgspec.Struct):
    n: int


async def test_request_reply_json_and_msgpack(bus: BusContext) -> None:
    subj = bus.subjects.echo("unary")

    async def on_req(msg):  # type: ignore[no-untyped-def]
        await respond(msg, {"n": codec.decode(msg.data, msg.headers)["n"] + 1})

    await bus.nc.subscribe(subj, cb=on_req)
    await bus.nc.flush()
    assert await request(bus.nc, subj, {"n": 1}) == {"n": 2}
    assert await request(bus.nc, subj, Ping(5), msgpack=True, reply_type=Ping) == Ping(6)


@pytest.mark.parametrize("err,cls", [(BadRequest("x"), BadRequest), (NotFound("x"), NotFound),
                                     (Overloaded("busy"), Overloaded), (EngineDead("engine dead: boom"), EngineDead),
                                     (RemoteError("teapot", 418), RemoteError)])
async def test_errors_travel_typed(bus: BusContext, err, cls) -> None:  # type: ignore[no-untyped-def]
    subj = bus.subjects.echo("failing")

    async def on_req(msg):  # type: ignore[no-untyped-def]
        await respond(msg, err)

    await bus.nc.subscribe(subj, cb=on_req)
    await bus.nc.flush()
    with pytest.raises(cls) as ei:
        await request(bus.nc, subj, {})
    assert ei.value.code == err.code and str(ei.value) == str(err)


async def test_no_responders_and_timeout(bus: BusContext) -> None:
    with pytest.raises(Unavailable):
        await request(bus.nc, bus.subjects.echo("nobody"), {}, timeout=30)
    subj = bus.subjects.echo("silent")

    async def on_req(msg):  # type: ignore[no-untyped-def]
        pass

    await bus.nc.subscribe(subj, cb=on_req)
    await bus.nc.flush()
    with pytest.raises(RequestTimeout):
        await request(bus.nc, subj, {}, timeout=0.2)


def test_binary_and_connect_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert nats_server_binary().endswith("nats-server")
    o = connect_options(BusConfig(port=4333), "x")
    assert o["servers"] == ["nats://127.0.0.1:4333"] and o["max_reconnect_attempts"] == -1
    o = connect_options(BusConfig(url="nats://a:1,nats://b:2", auth=BusAuth(user="u", password="p")), "x")
    assert o["servers"] == ["nats://a:1", "nats://b:2"] and (o["user"], o["password"]) == ("u", "p")
    assert connect_options(BusConfig(url="nats://a:1", auth=BusAuth(token="t")), "x")["token"] == "t"
    delays = [RECONNECT.delay(i) for i in range(10)]
    assert all(0 < d <= 5.0 * 1.5 for d in delays) and delays[6] > delays[0]
