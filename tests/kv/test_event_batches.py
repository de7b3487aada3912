"""KV event messages: one event, or an array of them under ``Kv-Batch`` (actors.kv.contract)."""

from __future__ import annotations

import msgspec
import pytest

from actors.kv.contract import RouterKvEvent, StoredBlock, decode_events, encode_batch, encode_event
from bus import subjects as S

MSGPACK = {S.CONTENT_TYPE: S.CT_MSGPACK}


def _events(n: int) -> list[RouterKvEvent]:
    return [RouterKvEvent(instance="w", event_id=i, kind="stored", block_size=32,
                          stored=[StoredBlock(i + 1, i or None)]) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 15, 16, 300, 65535, 65536])
def test_a_batch_is_the_msgpack_array_of_its_events(n: int) -> None:
    """Every msgpack array header size (fixarray, array 16, array 32) decodes to the same events,
    in order, as msgspec's own encoding of the list."""
    events = _events(n)
    data = encode_batch([encode_event(e) for e in events])
    assert data == msgspec.msgpack.encode(events)
    assert decode_events(data, {**MSGPACK, S.KV_BATCH: str(n)}) == events


def test_one_event_without_the_header_and_json_either_way() -> None:
    ev = _events(1)[0]
    assert decode_events(encode_event(ev), MSGPACK) == [ev]
    assert decode_events(msgspec.json.encode(ev), None) == [ev]  # `nats pub` without headers
    assert decode_events(msgspec.json.encode(_events(3)), {S.KV_BATCH: "3"}) == _events(3)


@pytest.mark.parametrize("data, headers", [
    (encode_event(_events(1)[0]), {**MSGPACK, S.KV_BATCH: "1"}),  # the header says array: one event is not
    (encode_batch([encode_event(e) for e in _events(2)]), MSGPACK),  # an array without the header
    (b'[{"instance": "w"}]', {S.KV_BATCH: "1"}),  # an event without its fields
])
def test_a_message_that_is_not_what_its_headers_say_is_refused(data: bytes, headers: dict[str, str]) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_events(data, headers)
