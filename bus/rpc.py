"""Request/reply over NATS with typed errors; streaming lives in ``bus.stream`` (re-exported here).

This is the transport boundary: NATS exceptions become ``bus.errors`` types here, so actor logic
never imports ``nats``. Errors travel as ADR-32 service errors (``Nats-Service-Error`` and
``Nats-Service-Error-Code`` headers, empty body), which is also what ``nats req`` prints.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus import codec
from bus.errors import ActorError, RequestTimeout, Unavailable
from bus.stream import StreamCall, stream_request
from bus.stream_responder import StreamCancels, respond_stream
from bus.tasks import honouring_cancel
from bus.wire import decode_payload, encode_payload, error_headers, raise_if_error

log = logging.getLogger(__name__)

async def request(nc: Client, subject: str, payload: Any, *, timeout: float = 5.0, msgpack: bool = False,
                  reply_type: Any = None, headers: dict[str, str] | None = None) -> Any:
    """Unary request. Raises Unavailable (no responders, at once), RequestTimeout, or the remote's typed error."""
    hdrs = codec.headers_for(msgpack)
    if headers:
        hdrs.update(headers)
    try:
        msg = await honouring_cancel(nc.request(subject, encode_payload(payload, msgpack), timeout=timeout,
                                                headers=hdrs))
    except nats.errors.NoRespondersError:
        raise Unavailable(f"no responders on {subject}") from None
    except nats.errors.TimeoutError:
        raise RequestTimeout(f"no reply on {subject} within {timeout}s") from None
    raise_if_error(msg.headers)
    return decode_payload(msg.data, msg.headers, reply_type)


async def respond(msg: Msg, obj_or_error: Any, headers: Mapping[str, str] | None = None) -> None:
    """Unary reply in the request's encoding (msgpack if the request was msgpack, else JSON)."""
    if not msg.reply:
        return
    if isinstance(obj_or_error, ActorError):
        data, hdrs = b"", error_headers(obj_or_error)
    else:
        mp = codec.is_msgpack(msg.headers)
        data, hdrs = encode_payload(obj_or_error, mp), codec.headers_for(mp)
    if headers:
        hdrs.update(headers)
    await msg._client.publish(msg.reply, data, headers=hdrs)



__all__ = ["request", "respond", "stream_request", "respond_stream", "StreamCall", "StreamCancels",
           "decode_payload", "encode_payload", "error_headers", "raise_if_error"]
