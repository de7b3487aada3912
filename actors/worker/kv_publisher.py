"""KV publisher actor: the engine's ZMQ KV events → numbered router events on NATS, plus an index.

One actor per worker process, next to the engine actor. Per DP rank it

* SUBscribes to the engine's ZMQ PUB socket (vLLM wire format, actors.engines.kv_events);
* catches up through the engine's replay ROUTER from seq 0 at start: vLLM's PUB drops everything
  published before a subscriber connects (and before its subscription propagates), and a publisher
  restarted after the engine would otherwise start mid-stream with orphaned continuations;
* fills a ZMQ seq gap through the replay endpoint, and probes it when idle so a dropped *last*
  batch (no later seq to reveal the gap) is not missed for long; unfillable gaps are counted;
* feeds a :class:`KvTranslator` (router hashes from tokens, event ids per rank from 0, local index)
  and publishes each :class:`RouterKvEvent` (msgpack) on ``Subjects.kv_events(instance)``.

Endpoints on ``Subjects.kv_index(instance, "dump" | "range")`` answer :class:`KvDumpRequest` /
:class:`KvRangeRequest` in the caller's encoding (JSON without headers, as ``nats req`` sends).
A decode worker publishes nothing (its blocks are never reusable prefixes for routing), so for
role "decode" no ZMQ socket is opened at all; the endpoints still answer (empty).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import zmq
import zmq.asyncio

from actors.base import Actor, Endpoint
from actors.engines.kv_events import decode_batch, is_replay_end, replay_request
from actors.engines.protocol import NO_KV_EVENT_ROLES, KvEventSource
from actors.kv.contract import (
    KvDumpReply,
    KvDumpRequest,
    KvRangeReply,
    KvRangeRequest,
    RouterKvEvent,
    encode_batch,
    encode_event,
)
from actors.kv.translate import KvPublisherMetrics, KvTranslator
from actors.worker import contract as C
from bus import rpc
from bus import subjects as S
from bus.context import BusContext
from bus.errors import NotFound
from bus.tasks import cancel_and_wait
from config.names import check_token
from supervisors.child import ChildSpec, LazyChild

if TYPE_CHECKING:
    from actors.worker.process import WorkerEnv

log = logging.getLogger(__name__)

_MSGPACK_HEADERS = {S.CONTENT_TYPE: S.CT_MSGPACK}


DRAIN_MAX = 64  # ZMQ messages read per wake-up of a rank's loop
# a KV event message's payload stays far below any server's max_payload (1 MiB by default): a bigger
# engine batch (a long prompt's first step stores thousands of blocks) goes as several messages
BATCH_BYTES = 256 * 1024


class _RankFeed:
    """ZMQ side of one DP rank: SUB socket, replay requests, seq bookkeeping."""

    def __init__(self, ctx: zmq.asyncio.Context, source: KvEventSource, translator: KvTranslator) -> None:
        self.source = source
        self.translator = translator
        self.ctx = ctx
        self.next_seq = 0  # the next vLLM batch seq we expect
        self.batches = 0
        self.replayed = 0
        self.replays = 0
        self.unfilled_gaps = 0
        self.decode_errors = 0
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        self.sub.connect(source.endpoint)
        # the same socket without the asyncio wrapper: once poll() said a batch is there, the rest of
        # what arrived is read without a future and an event registration per message
        self.sub_now = zmq.Socket.shadow(self.sub.underlying)

    def close(self) -> None:
        self.sub.close(linger=0)


class KvPublisherActor(Actor):
    kind: ClassVar[str] = "kv_publisher"
    description: ClassVar[str] = "KV publisher: engine KV events as router events, with dump/range index"
    version: ClassVar[str] = "0.1.0"

    def __init__(self, bus: BusContext, worker_instance: str, role: str, model: str, block_size: int,
                 sources: Sequence[KvEventSource], *, ring_size: int = 10_000,
                 metrics: KvPublisherMetrics | None = None, replay_timeout: float = 2.0,
                 idle_probe: float = 2.0, instance: str | None = None, register: bool = True) -> None:
        super().__init__(bus, instance=instance or f"{check_token(worker_instance)}-kvpub", role=role,
                         model=model, register=register)
        self.worker_instance = worker_instance
        self.block_size = block_size
        self.sources = list(sources)
        self.replay_timeout = replay_timeout
        self.idle_probe = idle_probe
        # the worker passes its WorkerEnv.kv_metrics, so the counters outlive a restarted publisher;
        # without one (tests), a private registry
        self.kv_metrics = metrics or KvPublisherMetrics()
        self.silent = role == "decode"
        self.subject = bus.subjects.kv_events(worker_instance)
        epoch = time.time_ns()  # one incarnation for all ranks of this publisher
        self.translators: dict[int, KvTranslator] = {
            s.dp_rank: KvTranslator(worker_instance, s.dp_rank, block_size=block_size, ring_size=ring_size,
                                    metrics=self.kv_metrics, epoch=epoch)
            for s in self.sources}
        self.published = 0
        self.publish_errors = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._ranks: list[_RankFeed] = []
        self._tasks: list[asyncio.Task[None]] = []

    # --- actor surface -----------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        s = self.bus.subjects
        return [
            Endpoint("kv_dump", s.kv_index(self.worker_instance, "dump"), self.dump, KvDumpRequest,
                     bounded=False),
            Endpoint("kv_range", s.kv_index(self.worker_instance, "range"), self.range, KvRangeRequest,
                     bounded=False),
        ]

    def record(self) -> dict[str, Any]:
        rec = dict(super().record())  # type: ignore[arg-type]
        rec.update({"worker_instance": self.worker_instance, "block_size": self.block_size,
                    "dp_size": max(1, len(self.sources))})
        return rec

    def metadata(self) -> dict[str, str]:
        md = super().metadata()
        md["worker_instance"] = self.worker_instance
        return md

    def statistics(self) -> dict[str, Any]:
        ranks = {}
        for r in self._ranks:
            t = r.translator
            ranks[str(r.source.dp_rank)] = {
                "next_zmq_seq": r.next_seq, "batches": r.batches, "replayed_batches": r.replayed,
                "replays": r.replays, "unfilled_gaps": r.unfilled_gaps, "decode_errors": r.decode_errors,
                "last_event_id": t.last_event_id, "blocks": t.num_blocks()}
        m = self.kv_metrics
        return {"worker_instance": self.worker_instance, "silent": self.silent,
                "block_size": self.block_size, "published": self.published,
                "publish_errors": self.publish_errors,
                "block_size_mismatch": _sample(m, "vllm_actors_kv_publisher_block_size_mismatch_total"),
                "zmq_gaps": _sample(m, "vllm_actors_kv_publisher_zmq_gaps_total"), "ranks": ranks}

    async def on_start(self) -> None:
        if self.silent:
            log.info("KV publisher %s: role decode, publishing nothing", self.worker_instance)
            return
        if not self.sources:
            log.warning("KV publisher %s: the engine exposes no KV event sources (prefix caching or "
                        "KV events off?); the router will see no blocks from it", self.worker_instance)
            return
        self._ctx = zmq.asyncio.Context()
        for src in self.sources:
            rank = _RankFeed(self._ctx, src, self.translators[src.dp_rank])
            self._ranks.append(rank)
            self._tasks.append(asyncio.create_task(self._run_rank(rank),
                                                   name=f"kvpub-{self.worker_instance}-{src.dp_rank}"))

    async def on_stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        for r in self._ranks:
            r.close()
        self._ranks = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- index endpoints ---------------------------------------------------------------------------
    async def dump(self, req: KvDumpRequest, headers: Mapping[str, str]) -> KvDumpReply:
        if req.dp_rank is not None and req.dp_rank not in self.translators and not self.silent:
            raise NotFound(f"{self.worker_instance} has no DP rank {req.dp_rank}")
        snaps = [t.snapshot() for r, t in sorted(self.translators.items())
                 if not self.silent and (req.dp_rank is None or r == req.dp_rank)]
        return KvDumpReply(instance=self.worker_instance, snapshots=snaps)

    async def range(self, req: KvRangeRequest, headers: Mapping[str, str]) -> KvRangeReply:
        t = None if self.silent else self.translators.get(req.dp_rank)
        if t is None:
            if self.silent:
                return KvRangeReply(instance=self.worker_instance, dp_rank=req.dp_rank, events=[],
                                    complete=True, first_event_id=-1, last_event_id=-1)
            raise NotFound(f"{self.worker_instance} has no DP rank {req.dp_rank}")
        return t.range(req.start_event_id, req.end_event_id)

    # --- ZMQ → NATS ----------------------------------------------------------------------------------
    async def _run_rank(self, rank: _RankFeed) -> None:
        src = rank.source
        try:
            # The SUB socket is already connected; catch up on what it cannot have seen.
            if src.replay_endpoint:
                await self._replay(rank)
            while True:
                timeout_ms = int(self.idle_probe * 1000) if src.replay_endpoint and self.idle_probe else None
                if await rank.sub.poll(timeout_ms) == 0:
                    # Idle: a dropped last batch shows no later seq; ask the replay for anything newer.
                    await self._replay(rank, quiet=True)
                    continue
                for _ in range(DRAIN_MAX):  # bounded: a burst must not hold the loop (heartbeats, streams)
                    try:
                        frames = rank.sub_now.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._on_frames(rank, frames)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken socket is a crash: the worker supervisor restarts us
            log.exception("KV publisher %s/%d: event loop failed", self.worker_instance, src.dp_rank)
            self.fail(e)

    async def _on_frames(self, rank: _RankFeed, frames: list[bytes]) -> None:
        if len(frames) < 3:
            rank.decode_errors += 1
            log.warning("KV publisher %s/%d: ignoring a %d-frame ZMQ message", self.worker_instance,
                        rank.source.dp_rank, len(frames))
            return
        seq = int.from_bytes(frames[-2], "big", signed=True)
        if seq < rank.next_seq:
            return  # already applied (replay overlap)
        if seq > rank.next_seq and rank.source.replay_endpoint:
            log.info("KV publisher %s/%d: ZMQ seq %d, expected %d; replaying the gap",
                     self.worker_instance, rank.source.dp_rank, seq, rank.next_seq)
            await self._replay(rank)
            if seq < rank.next_seq:
                return
        if seq > rank.next_seq:
            rank.unfilled_gaps += 1  # the translator counts it in vllm_actors_kv_publisher_zmq_gaps_total
        await self._apply(rank, seq, frames[-1])

    async def _apply(self, rank: _RankFeed, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            rank.decode_errors += 1
            rank.next_seq = seq + 1
            log.error("KV publisher %s/%d: undecodable batch seq %d: %s", self.worker_instance,
                      rank.source.dp_rank, seq, e)
            return
        rank.next_seq = seq + 1
        rank.batches += 1
        events = rank.translator.translate(batch, seq)
        if events:
            await self._publish(events)

    async def _publish(self, events: list[RouterKvEvent]) -> None:
        """What one engine batch changed, as one NATS message (``Kv-Batch: n``): one publish, one
        route in nats-server and one parse per router for a step's events, instead of one per event.
        A lone event goes as the plain event message; a batch over BATCH_BYTES is split."""
        group: list[tuple[RouterKvEvent, bytes]] = []
        size = 0
        for ev in events:
            data = encode_event(ev)
            if group and size + len(data) > BATCH_BYTES:
                await self._send(group)
                group, size = [], 0
            group.append((ev, data))
            size += len(data)
        await self._send(group)

    async def _send(self, group: list[tuple[RouterKvEvent, bytes]]) -> None:
        n = len(group)
        try:
            if n == 1:
                await self.bus.nc.publish(self.subject, group[0][1], headers=_MSGPACK_HEADERS)
            else:
                await self.bus.nc.publish(self.subject, encode_batch([data for _, data in group]),
                                          headers={**_MSGPACK_HEADERS, S.KV_BATCH: str(n)})
            self.published += n
        except Exception as e:  # routers recover the events through `range`
            self.publish_errors += n
            log.warning("KV publisher %s: publishing events %d..%d failed: %s", self.worker_instance,
                        group[0][0].event_id, group[-1][0].event_id, e)

    async def _replay(self, rank: _RankFeed, quiet: bool = False) -> None:
        """Fetch and apply every buffered batch with seq >= next_seq from the engine's replay socket."""
        assert self._ctx is not None and rank.source.replay_endpoint
        start = rank.next_seq
        sock = self._ctx.socket(zmq.DEALER)  # fresh socket: a late reply can never pollute the next one
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(rank.source.replay_endpoint)
            rank.replays += 1
            await sock.send_multipart(replay_request(start))
            while True:
                if await sock.poll(int(self.replay_timeout * 1000)) == 0:
                    if not quiet:
                        log.warning("KV publisher %s/%d: replay from seq %d timed out after %.1fs",
                                    self.worker_instance, rank.source.dp_rank, start, self.replay_timeout)
                    return
                frames = await sock.recv_multipart()
                if is_replay_end(frames):
                    return
                if len(frames) < 3:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < rank.next_seq:
                    continue
                if seq > rank.next_seq:
                    rank.unfilled_gaps += 1
                    log.warning("KV publisher %s/%d: replay starts at seq %d, needed %d; %d batches lost "
                                "(engine ring too small?)", self.worker_instance, rank.source.dp_rank,
                                seq, rank.next_seq, seq - rank.next_seq)
                rank.replayed += 1
                await self._apply(rank, seq, frames[-1])
        finally:
            sock.close(linger=0)


def _sample(m: KvPublisherMetrics, name: str) -> int:
    return int(m.registry.get_sample_value(name) or 0)


def worker_child(env: WorkerEnv) -> ChildSpec | None:
    """The worker's KV publisher: none for decode workers (their blocks are never routed to) and
    encode workers (an encode-only engine has no KV cache)."""
    if env.pool.role in NO_KV_EVENT_ROLES:
        return None
    model = env.topology.model.name if env.topology.model else ""

    async def build() -> KvPublisherActor:
        ctx = env.ctx.child()
        # Ask the engine actor (over NATS, like any other actor would) where its events are.
        info = await rpc.request(ctx.nc, ctx.subjects.worker(env.instance, C.ENGINE_KV_SOURCES), {},
                                 timeout=10.0, reply_type=C.EngineKvSources)
        return KvPublisherActor(ctx, env.instance, env.pool.role, model, info.block_size, info.sources,
                                metrics=env.kv_metrics)

    return ChildSpec("kv_publisher", lambda: LazyChild("kv_publisher", build), "permanent", 5.0)
