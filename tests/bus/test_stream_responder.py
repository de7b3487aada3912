"""The responder side of streaming RPC against garbage from a caller: protocol headers it reads
(``Stall-Timeout``) and the cancel subject's payload."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from actors.echo.actor import EchoActor
from bus import subjects as S
from bus.context import BusContext
from bus.errors import BadRequest
from bus.rpc import request
from bus.stream_responder import MAX_REQUEST_ID, heartbeat_interval
from bus.wire import DEFAULT_STALL, HEARTBEAT_FRACTION


def _msg(stall: str | None) -> Msg:
    return Msg(_client=None, subject="s", reply="r", headers=None if stall is None else {S.STALL_TIMEOUT: stall})  # type: ignore[arg-type]


@pytest.mark.parametrize("stall", [None, "nan", "inf", "-inf", "-1", "0", "fuzz", "1e999"])
def test_a_garbage_stall_timeout_gets_the_default_heartbeat(stall: str | None) -> None:
    # "nan" and "0" meant a heartbeat every 10 ms for the life of the stream; "inf" none at all,
    # and a vanished caller is noticed through the heartbeats
    assert heartbeat_interval(_msg(stall), None) == DEFAULT_STALL * HEARTBEAT_FRACTION


def test_a_sane_stall_timeout_sets_the_heartbeat() -> None:
    assert heartbeat_interval(_msg("3"), None) == 1.0
    assert heartbeat_interval(_msg("0.003"), None) == 0.01  # floor
    assert heartbeat_interval(_msg("30"), 2.0) == 2.0  # the responder's own bound wins


@pytest.fixture
async def echo(bus: BusContext):  # type: ignore[no-untyped-def]
    actor = EchoActor(bus, role="example", model="none", register=False)
    await actor.start()
    yield actor
    await actor.stop(1.0)


async def test_cancel_refuses_an_overlong_request_id(bus: BusContext, echo: EchoActor) -> None:
    subject = echo.cancel_subject()
    assert await request(bus.nc, subject, b"no-such-id") == {"cancelled": False, "request_id": "no-such-id"}
    # its reply echoes the id: one near max_payload failed to send (a 500 "MaxPayloadError")
    for rid in ("r" * (MAX_REQUEST_ID + 1), "r" * (bus.nc.max_payload - 64)):
        with pytest.raises(BadRequest, match="at most 256 characters"):
            await request(bus.nc, subject, rid.encode())
    with pytest.raises(BadRequest):
        await request(bus.nc, subject, b"", headers={S.REQUEST_ID: "h" * 1000})
    assert await request(bus.nc, subject, b"", headers={S.REQUEST_ID: "x"}) == {"cancelled": False,
                                                                                "request_id": "x"}
