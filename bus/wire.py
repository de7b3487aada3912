"""Wire helpers shared by the unary and streaming RPC: payload (de)coding with cached typed
decoders, and the ADR-32 error headers (``Nats-Service-Error`` / ``-Code``, plus our ``Error-Kind``) in both
directions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from bus import codec
from bus import subjects as S
from bus.errors import ActorError, Unavailable, error_from_wire

STATUS = "Status"  # nats-py puts the server's inline status (e.g. 503 no responders) here
NO_RESPONDERS = "503"
DEFAULT_STALL = 10.0
HEARTBEAT_FRACTION = 1 / 3  # heartbeat at a third of the caller's stall timeout

_decoders: dict[tuple[bool, Any], Any] = {}



# --- wire helpers (shared with bus.rpc) -----------------------------------------------------------
def decode_payload(data: bytes, headers: Mapping[str, str] | None, type: Any = None, *,
                   allow_empty: bool = True) -> Any:
    """Decode by Content-Type with cached typed decoders (hot path of streams).

    ``allow_empty=False``: an empty payload is a BadRequest instead of ``{}`` (strict control verbs).
    """
    if type is None or (not data and not allow_empty):
        return codec.decode(data, headers, type, allow_empty=allow_empty)
    mp = codec.is_msgpack(headers)
    dec = _decoders.get((mp, type))
    if dec is None:
        dec = (msgspec.msgpack.Decoder if mp else msgspec.json.Decoder)(type)
        _decoders[(mp, type)] = dec
    if not data and not mp:
        data = b"{}"
    try:
        return dec.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return codec.decode(data, headers, type)  # raises BadRequest with the precise message


def encode_payload(payload: Any, msgpack: bool) -> bytes:
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    return codec.encode(payload, msgpack=msgpack)


# Characters of an error's text that travel in ``Nats-Service-Error``. Messages may quote the request
# (a model name, a request id), and headers count against the server's max_payload: a reply over it
# is a protocol violation for which the server closes the *responder's* connection.
MAX_ERROR_TEXT = 1024


def bounded_text(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def error_headers(err: ActorError, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    h = {S.SERVICE_ERROR: bounded_text(err.message or type(err).__name__), S.SERVICE_ERROR_CODE: str(err.code),
         S.ERROR_KIND: err.kind}
    if extra:
        h.update(extra)
    return h


def raise_if_error(headers: Mapping[str, str] | None) -> None:
    """Turn a service-error or no-responders message into the typed exception."""
    if not headers:
        return
    if headers.get(STATUS) == NO_RESPONDERS:
        raise Unavailable("no responders")
    desc = headers.get(S.SERVICE_ERROR)
    if desc is not None or S.SERVICE_ERROR_CODE in headers:
        try:
            code = int(headers.get(S.SERVICE_ERROR_CODE, "500"))
        except ValueError:
            code = 500
        raise error_from_wire(desc or "remote error", code, headers.get(S.ERROR_KIND))
