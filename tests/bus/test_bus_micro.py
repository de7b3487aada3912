"""$SRV.PING/INFO/STATS replies of a real actor validate against the NATS CLI's micro schemas; malformed
or oversized input is a small typed error reply, never a 500 or a lost connection."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from nats.aio.msg import Msg

from actors.base import Actor, Endpoint
from actors.echo.actor import EchoActor
from bus import subjects as S
from bus.context import BusContext
from bus.errors import BadRequest, NotFound
from bus.micro import EndpointSpec, add_service
from bus.rpc import request
from bus.wire import MAX_ERROR_TEXT

SCHEMAS = Path(__file__).resolve().parents[1] / "fixtures" / "micro_schemas"


def schema(kind: str) -> dict:  # type: ignore[type-arg]
    return json.loads((SCHEMAS / f"io.nats.micro.v1.{kind}_response.json").read_text())


async def srv(bus: BusContext, subject: str) -> dict:  # type: ignore[type-arg]
    msg = await bus.nc.request(subject, b"", timeout=2)
    return json.loads(msg.data)


@pytest.fixture
async def echo(bus: BusContext):  # type: ignore[no-untyped-def]
    actor = EchoActor(bus, role="example", model="none")
    await actor.start()
    yield actor
    await actor.stop(2.0)


async def test_srv_replies_validate(bus: BusContext, echo: EchoActor) -> None:
    await request(bus.nc, bus.subjects.echo("echo"), {"message": "hi"})
    with pytest.raises(BadRequest):
        await request(bus.nc, bus.subjects.echo("echo"), {"nope": 1})
    sid = echo._service.id  # type: ignore[union-attr]
    for verb in ("PING", "INFO", "STATS"):
        for subject in (f"$SRV.{verb}.echo.{sid}",):
            reply = await srv(bus, subject)
            jsonschema.validate(reply, schema(verb.lower()))
            assert reply["id"] == sid and reply["name"] == "echo"
            assert reply["metadata"]["instance"] == echo.instance
            assert reply["metadata"]["namespace"] == bus.namespace
    info = await srv(bus, f"$SRV.INFO.echo.{sid}")
    assert info["description"] == EchoActor.description
    assert {e["name"] for e in info["endpoints"]} == {"echo", "stream", "crash", "cancel"}
    stats = await srv(bus, f"$SRV.STATS.echo.{sid}")
    ep = {e["name"]: e for e in stats["endpoints"]}
    assert ep["echo"]["num_requests"] == 2 and ep["echo"]["num_errors"] == 1
    assert ep["echo"]["last_error"].startswith("400:")
    assert ep["echo"]["data"]["echoed"] == 1  # the actor's statistics() feed STATS data


async def test_schemas_reject_invalid_replies(bus: BusContext) -> None:
    """The vendored schemas are not vacuous: a malformed reply fails validation."""
    svc = await add_service(bus.nc, name="probe", version="1.2.3", description="d", metadata={"a": "b"},
                            endpoints=[], stats=dict)
    try:
        ping = await srv(bus, f"$SRV.PING.probe.{svc.id}")
        jsonschema.validate(ping, schema("ping"))
        for bad in ({**ping, "version": "one"}, {**ping, "metadata": {"a": 1}}, {**ping, "extra": 1},
                    {k: v for k, v in ping.items() if k != "id"}):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema("ping"))
        stats = await srv(bus, f"$SRV.STATS.probe.{svc.id}")
        jsonschema.validate(stats, schema("stats"))
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**stats, "type": "io.nats.micro.v1.info_response"}, schema("stats"))
    finally:
        await svc.stop()


async def test_invalid_service_definitions(bus: BusContext) -> None:
    for name, version in (("bad name", "1.0.0"), ("ok", "1.0")):
        with pytest.raises(ValueError):
            await add_service(bus.nc, name=name, version=version, description="", metadata={},
                              endpoints=[], stats=dict)

    async def h(msg):  # type: ignore[no-untyped-def]
        pass

    with pytest.raises(ValueError):
        await add_service(bus.nc, name="ok", version="1.0.0", description="", metadata={},
                          endpoints=[EndpointSpec("bad.name", "x.y", h)], stats=dict)


class Plain(Actor):
    """Untyped endpoints (request_type None), unary and streaming: msgspec decodes them as ``Any``."""

    kind = "plain"

    def endpoints(self) -> list[Endpoint]:
        s = self.bus.subjects
        return [Endpoint("any", s.actor(self.kind, self.instance, "any"), self.any),
                Endpoint("stream", s.actor(self.kind, self.instance, "stream"), self.stream, streaming=True)]

    async def any(self, req: Any, _h: Any) -> dict[str, str]:
        return {"got": type(req).__name__}

    async def stream(self, req: Any, _h: Any) -> AsyncIterator[dict[str, str]]:
        yield {"got": type(req).__name__}


DEEP = 100_000


@pytest.mark.parametrize("data,headers", [
    (b"[" * DEEP + b"]" * DEEP, None),
    (b'{"a":' * DEEP + b"1" + b"}" * DEEP, None),
    (b"\x91" * DEEP + b"\x90", {S.CONTENT_TYPE: S.CT_MSGPACK}),
    (b'{"x": "\xff\xfe"}', None),
], ids=["json-arrays", "json-objects", "msgpack-arrays", "invalid-utf8"])
async def test_malformed_payloads_are_a_400_on_unary_and_streaming_endpoints(
        bus: BusContext, data: bytes, headers: dict[str, str] | None) -> None:
    # deep nesting escaped msgspec as RecursionError: a 500 ("internal error: RecursionError")
    actor = Plain(bus, register=False)
    await actor.start()
    try:
        for verb in ("any", "stream"):
            msg = await bus.nc.request(bus.subjects.actor("plain", actor.instance, verb), data,
                                       headers=headers, timeout=5)
            assert msg.headers is not None and msg.headers[S.SERVICE_ERROR_CODE] == "400", msg.headers
        stats = await srv(bus, f"$SRV.STATS.plain.{actor._service.id}")  # type: ignore[union-attr]
        assert {e["last_error"][:4] for e in stats["endpoints"] if e["num_errors"]} == {"400:"}
        assert await request(bus.nc, bus.subjects.actor("plain", actor.instance, "any"), [1]) == {"got": "list"}
    finally:
        await actor.stop(1.0)


async def test_an_error_quoting_a_huge_request_stays_small(bus: BusContext) -> None:
    """An error message that quotes the request (a model name, an id) is cut in Nats-Service-Error.
    Headers count against max_payload: a reply over it made the server close the responder's
    connection (nats-py then closes it for good), taking the whole process off the bus."""
    async def lookup(msg: Msg) -> None:
        raise NotFound(f"no model {msg.data.decode()!r}")

    svc = await add_service(bus.nc, name="lookup", version="1.0.0", description="", metadata={},
                            endpoints=[EndpointSpec("get", bus.subjects.echo("lookup"), lookup)], stats=dict)
    try:
        name = "m" * (bus.nc.max_payload - 64)
        with pytest.raises(NotFound) as ei:
            await request(bus.nc, bus.subjects.echo("lookup"), name.encode())
        assert len(ei.value.message) < MAX_ERROR_TEXT + 64
        assert ei.value.message.startswith("no model 'mmm") and "more characters)" in ei.value.message
        assert bus.nc.is_connected
        stats = await srv(bus, f"$SRV.STATS.lookup.{svc.id}")
        assert stats["endpoints"][0]["num_errors"] == 1
        assert len(stats["endpoints"][0]["last_error"]) < MAX_ERROR_TEXT + 64
    finally:
        await svc.stop()
