"""bus.codec.decode and bus.wire.decode_payload: empty payloads (allowed or not), and every kind of
malformed input — invalid UTF-8 included — is a BadRequest (400), never another exception (a 500)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import pytest

from bus import codec, wire
from bus import subjects as S
from bus.errors import BadRequest

MSGPACK = {S.CONTENT_TYPE: S.CT_MSGPACK}


class Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    level: int = 1
    mode: Literal["drain", "abort"] = "drain"


class Named(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


def both(data: bytes, headers: Any = None, type: Any = None, **kw: Any) -> list[Any]:
    """Decode through codec.decode and wire.decode_payload (twice: cold, then cached decoder)."""
    return [codec.decode(data, headers, type, **kw), wire.decode_payload(data, headers, type, **kw),
            wire.decode_payload(data, headers, type, **kw)]


def both_raise(data: bytes, headers: Any = None, type: Any = None, **kw: Any) -> list[str]:
    msgs = []
    for fn in (codec.decode, wire.decode_payload, wire.decode_payload):
        with pytest.raises(BadRequest) as ei:
            fn(data, headers, type, **kw)
        assert ei.value.code == 400
        msgs.append(ei.value.message)
    return msgs


def test_empty_payload_is_an_empty_object_by_default() -> None:
    assert both(b"") == [{}, {}, {}]
    assert both(b"", type=Strict) == [Strict()] * 3
    with pytest.raises(BadRequest, match="missing required field `name`"):
        wire.decode_payload(b"", None, Named)


@pytest.mark.parametrize("headers", [None, {}, MSGPACK], ids=["no-headers", "empty-headers", "msgpack"])
@pytest.mark.parametrize("type", [Strict, None], ids=["typed", "untyped"])
def test_empty_payload_refused_when_not_allowed(headers: Any, type: Any) -> None:
    for msg in both_raise(b"", headers, type, allow_empty=False):
        assert "needs a JSON object" in msg and "'{}'" in msg


def test_strict_decoding_still_accepts_objects() -> None:
    assert both(b"{}", type=Strict, allow_empty=False) == [Strict()] * 3
    assert both(b'{"level": 2, "mode": "abort"}', type=Strict, allow_empty=False) == [Strict(level=2, mode="abort")] * 3
    packed = msgspec.msgpack.encode({"level": 0})
    assert both(packed, MSGPACK, Strict, allow_empty=False) == [Strict(level=0)] * 3


def test_the_typed_fast_path_keeps_its_cached_decoder() -> None:
    class Fresh(msgspec.Struct, forbid_unknown_fields=True):
        x: int = 0

    assert wire.decode_payload(b'{"x": 3}', None, Fresh, allow_empty=False) == Fresh(3)
    assert (False, Fresh) in wire._decoders
    cached = wire._decoders[(False, Fresh)]
    assert wire.decode_payload(b"{}", None, Fresh, allow_empty=False) == Fresh()
    assert wire._decoders[(False, Fresh)] is cached


@pytest.mark.parametrize("data,expect", [
    (b'{"bogus": 1}', "unknown field `bogus`"),
    (b"[]", "Expected `object`, got `array`"),
    (b"1", "Expected `object`, got `int`"),
    (b'"x"', "Expected `object`, got `str`"),
    (b"null", "Expected `object`, got `null`"),
    (b"not json", "malformed JSON payload"),
    (b"{", "malformed JSON payload"),
    (b"\xff\xfe", "malformed JSON payload"),
    (b'{"\xff": 1}', "invalid UTF-8"),  # msgspec < 0.23 raises UnicodeDecodeError here, later a DecodeError: same message
    (b'{"mode": "\xff"}', "invalid UTF-8"),
    (b'{"level": "x"}', "Expected `int`, got `str` - at `$.level`"),
    (b'{"mode": "sideways"}', "Invalid enum value 'sideways' - at `$.mode`"),
], ids=["unknown-field", "array", "int", "string", "null", "not-json", "truncated", "ff-fe", "bad-utf8-key",
        "bad-utf8-value", "wrong-type", "bad-enum"])
@pytest.mark.parametrize("allow_empty", [True, False])
def test_bad_payloads_are_bad_requests(data: bytes, expect: str, allow_empty: bool) -> None:
    for msg in both_raise(data, None, Strict, allow_empty=allow_empty):
        assert expect in msg, msg


def test_invalid_utf8_is_a_bad_request_untyped_and_msgpack() -> None:
    # untyped (request_type=None endpoints such as health): used to escape as UnicodeDecodeError
    assert "invalid UTF-8" in both_raise(b'{"name": "\xff"}')[0]
    assert "invalid UTF-8" in both_raise(b'"\xff"')[0]
    bad_str = b"\x81\xa4name\xa1\xff"  # msgpack {"name": <invalid UTF-8>}
    for msg in both_raise(bad_str, MSGPACK) + both_raise(bad_str, MSGPACK, Named):
        assert msg.startswith("malformed msgpack payload: invalid UTF-8"), msg


def test_empty_msgpack_default_is_still_a_decode_error() -> None:
    # unchanged: only JSON treats an empty payload as {} (msgpack has no "empty means {}" convention)
    assert "malformed msgpack payload" in both_raise(b"", MSGPACK, Strict)[0]


class Loose(msgspec.Struct, kw_only=True):
    params: dict[str, Any] | None = None  # what GenerateRequest.kv_transfer_params is typed


DEPTH = 100_000  # far past the interpreter's recursion limit, far below a NATS max payload


@pytest.mark.parametrize("data,headers,type", [
    (b"[" * DEPTH + b"]" * DEPTH, None, None),
    (b'{"a":' * DEPTH + b"1" + b"}" * DEPTH, None, None),
    (b'{"params": {"x": ' + b"[" * DEPTH + b"]" * DEPTH + b"}}", None, Loose),
    (b"\x91" * DEPTH + b"\x90", MSGPACK, None),  # msgpack [[[...]]]
    (b"\x81\xa6params\x81\xa1x" + b"\x91" * DEPTH + b"\x90", MSGPACK, Loose),
], ids=["json-arrays", "json-objects", "json-in-an-Any-field", "msgpack-arrays", "msgpack-in-an-Any-field"])
def test_deep_nesting_is_a_bad_request(data: bytes, headers: Any, type: Any) -> None:
    # msgspec raises RecursionError past the interpreter's recursion limit: it used to escape as a
    # 500 ("internal error: RecursionError") from every endpoint that decodes untyped or Any fields
    for msg in both_raise(data, headers, type):
        assert msg.endswith("payload: nested too deeply"), msg


def test_nesting_below_the_limit_still_decodes() -> None:
    data = b'{"params": {"x": ' + b"[" * 100 + b"]" * 100 + b"}}"
    assert [v.params is not None for v in both(data, type=Loose)] == [True] * 3
