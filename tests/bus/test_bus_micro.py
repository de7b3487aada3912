"""$SRV.PING/INFO/STATS replies of a real actor validate against the NATS CLI's micro schemas."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from actors.echo import EchoActor
from bus.context import BusContext
from bus.errors import BadRequest
from bus.micro import EndpointSpec, add_service
from bus.rpc import request

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
