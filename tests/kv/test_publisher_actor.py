"""KvPublisherActor on a real nats-server, fed by mocker engines (vLLM's ZMQ wire format) and by a
hand-driven ZMQ publisher that can drop a batch on purpose (to exercise the replay path)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from actors.engines.kv_events import KVEventBatch, encode_message, removed, stored
from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import KvEventSource, SamplingOptions, TokensPrompt
from actors.kv import hashing
from actors.kv.contract import KvDumpReply, KvRangeReply, RouterKvEvent, decode_events
from actors.worker import kv_publisher
from actors.worker.kv_publisher import KvPublisherActor
from bus import subjects as S
from bus.context import BusContext
from bus.registry import Registry
from tests.helpers import eventually

BS = 4
ARGS = {"speedup_ratio": 0, "block_size": BS, "num_gpu_blocks": 256, "max_model_len": 256}


async def generate(engine: MockerEngine, tokens: list[int], rid: str) -> list[int]:
    out: list[int] = []
    async for o in engine.generate(TokensPrompt(tokens), SamplingOptions(max_tokens=1), rid):
        out.extend(o.token_ids)
    return out


class EventSink:
    """Collects the router events published on one instance's subject."""

    def __init__(self) -> None:
        self.events: list[RouterKvEvent] = []
        self.content_types: set[str | None] = set()
        self.messages: list[list[RouterKvEvent]] = []  # the events of each NATS message
        self.batch_headers: list[str | None] = []  # each message's Kv-Batch header

    async def cb(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.content_types.add((msg.headers or {}).get(S.CONTENT_TYPE))
        self.batch_headers.append((msg.headers or {}).get(S.KV_BATCH))
        events = decode_events(msg.data, msg.headers)
        self.messages.append(events)
        self.events.extend(events)

    def stored_hashes(self) -> list[int]:
        return [b.seq_hash for e in self.events if e.kind == "stored" for b in e.stored]


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    e = MockerEngine(ARGS)
    await e.start()
    yield e
    await e.shutdown()


async def start_publisher(bus: BusContext, engine: MockerEngine, instance: str = "w1", *,
                          role: str = "agg", block_size: int = BS) -> tuple[KvPublisherActor, EventSink]:
    sink = EventSink()
    await bus.nc.subscribe(bus.subjects.kv_events(instance), cb=sink.cb)
    pub = KvPublisherActor(bus.child(), instance, role, "mock", block_size, engine.kv_event_sources())
    await pub.start()
    return pub, sink


async def test_events_carry_router_hashes_of_the_tokens(bus: BusContext, engine: MockerEngine) -> None:
    pub, sink = await start_publisher(bus, engine)
    try:
        prompt = list(range(100, 118))  # 18 tokens: 4 full blocks + 2
        out = await generate(engine, prompt, "r1")
        want = hashing.sequence_hashes(prompt, BS)
        await eventually(lambda: set(want) <= set(sink.stored_hashes()))
        # every published block is a prefix block of prompt + output, chained to its parent
        everything = hashing.sequence_hashes(prompt + out, BS)
        assert set(sink.stored_hashes()) <= set(everything)
        for e in sink.events:
            for b in e.stored:
                i = everything.index(b.seq_hash)
                assert b.parent == (everything[i - 1] if i else None)
        assert [e.event_id for e in sink.events] == list(range(len(sink.events)))
        assert all(e.instance == "w1" and e.dp_rank == 0 and e.block_size == BS for e in sink.events)
        assert sink.content_types == {S.CT_MSGPACK}
        # a second request extending the prompt stores only the new blocks, continuing the chain
        before = len(sink.stored_hashes())
        longer = prompt[:16] + list(range(500, 508))
        await generate(engine, longer, "r2")
        want2 = hashing.sequence_hashes(longer, BS)
        await eventually(lambda: set(want2) <= set(sink.stored_hashes()))
        assert len(sink.stored_hashes()) - before < len(want2)  # shared prefix not stored again
        # registry record (JSON) under the publisher's own key, pointing at its worker
        reg = Registry(bus.js, bus.subjects.bucket_instances)
        await reg.ensure()
        rec = json.loads(await reg.get(pub.instance) or b"{}")
        assert rec["kind"] == "kv_publisher" and rec["worker_instance"] == "w1" and rec["block_size"] == BS
    finally:
        await pub.stop(1.0)


async def test_started_after_the_engine_catches_up_through_replay(bus: BusContext,
                                                                   engine: MockerEngine) -> None:
    prompt = list(range(1, 13))
    await generate(engine, prompt, "early")  # published on ZMQ before anyone subscribed
    pub, sink = await start_publisher(bus, engine)
    try:
        await eventually(lambda: set(hashing.sequence_hashes(prompt, BS)) <= set(sink.stored_hashes()))
        assert sink.events[0].event_id == 0
        assert pub.statistics()["ranks"]["0"]["replayed_batches"] >= 1
    finally:
        await pub.stop(1.0)


async def test_decode_role_is_silent(bus: BusContext, engine: MockerEngine) -> None:
    pub, sink = await start_publisher(bus, engine, role="decode")
    try:
        assert pub._ranks == [] and pub._ctx is None  # no ZMQ socket at all
        await generate(engine, list(range(1, 30)), "d1")
        await asyncio.sleep(0.3)
        assert sink.events == []
        msg = await bus.nc.request(bus.subjects.kv_index("w1", "dump"), b"", timeout=2)
        assert json.loads(msg.data) == {"instance": "w1", "snapshots": []}
    finally:
        await pub.stop(1.0)


async def test_dump_and_range_with_headerless_json(bus: BusContext, engine: MockerEngine) -> None:
    pub, sink = await start_publisher(bus, engine)
    try:
        for i in range(3):
            await generate(engine, [7, 7, 7, 7] + list(range(10 * i, 10 * i + 8)), f"r{i}")
        await eventually(lambda: len(sink.events) >= 3)
        await asyncio.sleep(0.2)  # let the last steps' events arrive
        n = len(sink.events)
        # dump, exactly as `nats req ns.kv.index.w1.dump ''` sends it: no headers, empty body
        msg = await bus.nc.request(bus.subjects.kv_index("w1", "dump"), b"", timeout=2)
        assert (msg.headers or {}).get(S.CONTENT_TYPE, S.CT_JSON) == S.CT_JSON
        dump = msgspec.json.decode(msg.data, type=KvDumpReply)
        (snap,) = dump.snapshots
        assert snap.last_event_id == n - 1 and snap.block_size == BS
        assert {b.seq_hash for b in snap.blocks} == set(sink.stored_hashes())  # nothing evicted yet
        # range with plain JSON
        msg = await bus.nc.request(bus.subjects.kv_index("w1", "range"),
                                   json.dumps({"start_event_id": 1, "end_event_id": n - 1}).encode(),
                                   timeout=2)
        rng = msgspec.json.decode(msg.data, type=KvRangeReply)
        assert rng.complete and rng.first_event_id == 0 and rng.last_event_id == n - 1
        assert rng.events == sink.events[1:n]
        # malformed JSON: a typed 400, and the actor keeps serving
        msg = await bus.nc.request(bus.subjects.kv_index("w1", "range"), b'{"start_event_id": "x"}',
                                   timeout=2)
        assert msg.headers[S.SERVICE_ERROR_CODE] == "400"
        msg = await bus.nc.request(bus.subjects.kv_index("w1", "range"), b'{"dp_rank": 3, '
                                   b'"start_event_id": 0}', timeout=2)
        assert msg.headers[S.SERVICE_ERROR_CODE] == "404"
        msg = await bus.nc.request(bus.subjects.kv_index("w1", "dump"), b"", timeout=2)
        assert msgspec.json.decode(msg.data, type=KvDumpReply).snapshots[0].last_event_id == n - 1
    finally:
        await pub.stop(1.0)


async def test_block_size_mismatch_is_a_warning_and_a_metric(bus: BusContext, engine: MockerEngine,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="actors.kv.translate")
    pub, sink = await start_publisher(bus, engine, block_size=8)  # the engine uses 4
    try:
        await generate(engine, list(range(1, 20)), "m1")
        await eventually(lambda: len(sink.events) >= 1)
        assert pub.kv_metrics.registry.get_sample_value("vllm_actors_kv_publisher_block_size_mismatch_total") >= 1
        assert pub.statistics()["block_size_mismatch"] >= 1
        assert any("block size 4 differs from the configured 8" in r.getMessage() for r in caplog.records)
        # events say which block size they really use, so routers can flag it too
        assert sink.events[0].block_size == BS
    finally:
        await pub.stop(1.0)


async def test_dp_ranks_are_numbered_and_dumped_separately(bus: BusContext) -> None:
    engine = MockerEngine({**ARGS, "dp_size": 2})
    await engine.start()
    pub, sink = await start_publisher(bus, engine, "wdp")
    try:
        assert [s.dp_rank for s in engine.kv_event_sources()] == [0, 1]
        # concurrent requests spread over both ranks (the mocker picks the least loaded rank)
        await asyncio.gather(*(generate(engine, list(range(100 * i, 100 * i + 12)), f"d{i}")
                               for i in range(4)))
        await eventually(lambda: {e.dp_rank for e in sink.events} == {0, 1})
        await asyncio.sleep(0.2)
        for rank in (0, 1):
            ids = [e.event_id for e in sink.events if e.dp_rank == rank]
            assert ids == list(range(len(ids)))  # numbered per (instance, dp_rank) from 0
        msg = await bus.nc.request(bus.subjects.kv_index("wdp", "dump"), b"", timeout=2)
        snaps = msgspec.json.decode(msg.data, type=KvDumpReply).snapshots
        assert [s.dp_rank for s in snaps] == [0, 1]
        for s in snaps:
            assert {b.seq_hash for b in s.blocks} == {
                b.seq_hash for e in sink.events if e.dp_rank == s.dp_rank for b in e.stored}
        msg = await bus.nc.request(bus.subjects.kv_index("wdp", "dump"), b'{"dp_rank": 1}', timeout=2)
        assert [s.dp_rank for s in msgspec.json.decode(msg.data, type=KvDumpReply).snapshots] == [1]
    finally:
        await pub.stop(1.0)
        await engine.shutdown()


class HandPublisher:
    """vLLM's ZMQ PUB + replay ROUTER, driven by the test: it can skip a batch on the PUB socket."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)  # a PUB that also hands the test its subscriptions
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, list[bytes]]] = []
        self.seq = 0
        self.task = asyncio.create_task(self._serve())

    def source(self, replay: bool = True) -> KvEventSource:
        return KvEventSource(dp_rank=0, endpoint=f"tcp://127.0.0.1:{self.port}",
                             replay_endpoint=f"tcp://127.0.0.1:{self.rport}" if replay else None)

    async def subscribed(self) -> None:
        """Wait until the actor's SUB subscription has reached this socket (a fixed sleep lost the
        race on a loaded machine: PUB drops what it sends before then)."""
        async with asyncio.timeout(30):
            frame = await self.pub.recv()
        assert frame[:1] == b"\x01", frame  # a subscribe, not an unsubscribe

    async def send(self, tokens: list[int], hashes: list[int], parent: int | None, drop: bool = False) -> None:
        await self.send_events([stored(hashes, tokens, BS, parent_block_hash=parent)], drop)

    async def send_events(self, events: list, drop: bool = False) -> None:  # type: ignore[type-arg]
        """One engine batch of these vLLM events (what one step changed)."""
        batch = KVEventBatch(ts=time.time(), events=events)
        frames = encode_message(batch, self.seq)
        self.buffer.append((self.seq, frames))
        self.seq += 1
        if not drop:
            await self.pub.send_multipart(frames)

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, frames in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", *frames])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.mark.parametrize("replay", [True, False])
async def test_zmq_gap_is_replayed_or_counted(bus: BusContext, replay: bool) -> None:
    hp = HandPublisher()
    sink = EventSink()
    await bus.nc.subscribe(bus.subjects.kv_events("w9"), cb=sink.cb)
    pub = KvPublisherActor(bus.child(), "w9", "agg", "mock", BS, [hp.source(replay)], idle_probe=0.2)
    await pub.start()
    try:
        await hp.subscribed()
        toks = list(range(1, 13))
        await hp.send(toks[0:4], [11], None)
        await hp.send(toks[4:8], [12], 11, drop=True)  # lost on the PUB socket
        await hp.send(toks[8:12], [13], 12)
        want = hashing.sequence_hashes(toks, BS)
        if replay:
            await eventually(lambda: sink.stored_hashes() == want)
            assert pub.statistics()["zmq_gaps"] == 0
        else:
            await eventually(lambda: pub.statistics()["zmq_gaps"] == 1)
            await asyncio.sleep(0.1)
            # the continuation's parent was never seen: dropped, never mis-chained
            assert sink.stored_hashes() == want[:1]
        # a dropped *last* batch is found by the idle probe (there is no later seq to reveal it)
        await hp.send(list(range(50, 54)), [21], None, drop=True)
        if replay:
            await eventually(lambda: hashing.sequence_hashes(list(range(50, 54)), BS)[0]
                             in sink.stored_hashes())
    finally:
        await pub.stop(1.0)
        await hp.close()


async def test_one_engine_batch_is_one_nats_message(bus: BusContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """What one engine step changed travels as one message with ``Kv-Batch: n`` (events in id order);
    a lone event as the plain event message; a batch over the byte bound as several messages."""
    hp = HandPublisher()
    sink = EventSink()
    await bus.nc.subscribe(bus.subjects.kv_events("wb"), cb=sink.cb)
    pub = KvPublisherActor(bus.child(), "wb", "agg", "mock", BS, [hp.source()], idle_probe=0.2)
    await pub.start()
    try:
        await hp.subscribed()
        toks = list(range(1, 13))
        # three requests' blocks stored and one removed in one step: four events, one message
        await hp.send_events([stored([11], toks[0:4], BS), stored([12], toks[4:8], BS, parent_block_hash=11),
                              stored([31], toks[8:12], BS), removed([31])])
        await eventually(lambda: len(sink.events) == 4)
        assert sink.batch_headers == ["4"] and [len(m) for m in sink.messages] == [4]
        assert [e.event_id for e in sink.events] == [0, 1, 2, 3]
        assert [e.kind for e in sink.events] == ["stored", "stored", "stored", "removed"]
        await hp.send_events([removed([12])])  # a lone event: the plain message
        await eventually(lambda: len(sink.events) == 5)
        assert sink.batch_headers[-1] is None and sink.events[-1].event_id == 4
        # over the byte bound: split, in order, nothing lost
        monkeypatch.setattr(kv_publisher, "BATCH_BYTES", 200)
        many = [stored([100 + i], [1000 + 4 * i + j for j in range(BS)], BS) for i in range(20)]
        await hp.send_events(many)
        await eventually(lambda: len(sink.events) == 25)
        split = sink.messages[2:]
        assert len(split) > 1 and sum(len(m) for m in split) == 20
        assert [e.event_id for e in sink.events] == list(range(25))
        assert pub.statistics()["published"] == 25
    finally:
        await pub.stop(1.0)
        await hp.close()
