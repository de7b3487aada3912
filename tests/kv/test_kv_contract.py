"""Router KV event contract: msgpack round trip and plain JSON (as the NATS CLI sends)."""

import msgspec

from actors.kv.contract import (
    KvDumpReply,
    KvRangeRequest,
    KvSnapshot,
    RouterKvEvent,
    StoredBlock,
    decode_event,
    encode_event,
)


def test_event_roundtrip_with_u64_hashes():
    ev = RouterKvEvent(instance="w1", dp_rank=1, event_id=7, kind="stored", block_size=32,
                       stored=[StoredBlock(2**64 - 1, None), StoredBlock(5, 2**64 - 1)], lora_name="a")
    back = decode_event(encode_event(ev))
    assert back == ev
    assert back.worker == ("w1", 1)


def test_json_requests_decode():
    req = msgspec.json.decode(b'{"start_event_id": 3}', type=KvRangeRequest)
    assert (req.dp_rank, req.start_event_id, req.end_event_id) == (0, 3, None)
    ev = msgspec.json.decode(b'{"instance":"w","event_id":0,"kind":"removed","block_size":32,'
                             b'"removed":[1,2]}', type=RouterKvEvent)
    assert ev.removed == [1, 2] and ev.stored == []


def test_dump_reply_roundtrip():
    rep = KvDumpReply(instance="w", snapshots=[KvSnapshot(dp_rank=0, block_size=32, last_event_id=4,
                                                          blocks=[StoredBlock(1), StoredBlock(2, 1)])])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(rep), type=KvDumpReply) == rep
