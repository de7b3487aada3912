"""Payload codec: JSON or msgpack, chosen by the Content-Type header.

A message without Content-Type is JSON, which is what ``nats req`` sends. Hot paths (token streams,
KV events) use msgpack; control, registry and $SRV subjects use JSON so the CLI can read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from bus import subjects as S
from bus.errors import BadRequest

T = TypeVar("T")

_json_enc = msgspec.json.Encoder()
_mp_enc = msgspec.msgpack.Encoder()
_json_dec = msgspec.json.Decoder()
_mp_dec = msgspec.msgpack.Decoder()

JSON_HEADERS = {S.CONTENT_TYPE: S.CT_JSON}
MSGPACK_HEADERS = {S.CONTENT_TYPE: S.CT_MSGPACK}


def is_msgpack(headers: Mapping[str, str] | None) -> bool:
    return bool(headers) and headers.get(S.CONTENT_TYPE) == S.CT_MSGPACK  # type: ignore[union-attr]


def encode(obj: Any, msgpack: bool = False) -> bytes:
    return _mp_enc.encode(obj) if msgpack else _json_enc.encode(obj)


def headers_for(msgpack: bool) -> dict[str, str]:
    return dict(MSGPACK_HEADERS if msgpack else JSON_HEADERS)


INVALID_UTF8 = "invalid UTF-8 in a string"
EMPTY_NOT_ALLOWED = "empty payload: this verb needs a JSON object (send '{}' for the defaults)"


def decode(data: bytes, headers: Mapping[str, str] | None = None, type: type[T] | None = None, *,
           allow_empty: bool = True) -> T | Any:
    """Decode by Content-Type (default JSON).

    An empty payload decodes as an empty object (``{}``) when ``allow_empty``; otherwise it is a
    BadRequest (the strict control verbs, which must not act on a stray empty message).

    Raises BadRequest with a message naming the offending field, so every actor turns malformed
    input into a typed 400 instead of crashing. msgspec raises two other exceptions for bad input:
    UnicodeDecodeError for invalid UTF-8 inside a string (before 0.23; since then a DecodeError, and
    both give the same message), and RecursionError for nesting deeper than
    the interpreter's recursion limit (about 1000 levels: ``[[[...]]]`` untyped, or inside a field
    typed ``Any``) — both are the sender's fault, so both are a 400 too.
    """
    mp = is_msgpack(headers)
    if not data:
        if not allow_empty:
            raise BadRequest(EMPTY_NOT_ALLOWED)
        if not mp:
            data = b"{}"
    try:
        if type is None:
            return _mp_dec.decode(data) if mp else _json_dec.decode(data)
        if mp:
            return msgspec.msgpack.decode(data, type=type)
        return msgspec.json.decode(data, type=type)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        # msgspec >= 0.23 reports invalid UTF-8 as a DecodeError ("Invalid UTF-8 encoded string");
        # older releases raise UnicodeDecodeError. Either way the sender reads the same message.
        raise _malformed(mp, INVALID_UTF8 if "UTF-8" in str(e) else str(e)) from None
    except UnicodeDecodeError:
        raise _malformed(mp, INVALID_UTF8) from None
    except RecursionError:
        raise _malformed(mp, "nested too deeply") from None


def _malformed(mp: bool, detail: str) -> BadRequest:
    return BadRequest(f"malformed {'msgpack' if mp else 'JSON'} payload: {detail}")


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)
