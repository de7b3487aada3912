"""KvRouterFeed end to end: mocker engines → KV publisher actors → NATS → feed → KvRouter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import SamplingOptions, TokensPrompt
from actors.instances.contract import InstanceRecord
from actors.kv import hashing
from actors.kv.contract import RouterKvEvent, StoredBlock, encode_batch, encode_event
from actors.router.cost import RouterConfig
from actors.router.feed import KvRouterFeed
from actors.router.kv_router import KvRouter
from actors.worker.contract import LoadReport
from actors.worker.kv_publisher import KvPublisherActor
from bus import codec
from bus import subjects as S
from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats
from bus.registry import Registry
from tests.helpers import eventually

BS = 4
ARGS = {"speedup_ratio": 0, "block_size": BS, "num_gpu_blocks": 512, "max_model_len": 512}


@dataclass
class Worker:
    instance: str
    engine: MockerEngine
    pub: KvPublisherActor
    registry: Registry | None

    async def generate(self, tokens: list[int], rid: str) -> None:
        async for _ in self.engine.generate(TokensPrompt(tokens), SamplingOptions(max_tokens=1), rid):
            pass
        # the publisher has translated this request's blocks (ZMQ hop done)
        await eventually(lambda: set(hashing.sequence_hashes(tokens, BS)) <= self.blocks())

    def blocks(self) -> set[int]:
        return {b.seq_hash for b in self.pub.translators[0].snapshot().blocks}

    def last_event_id(self) -> int:
        return self.pub.translators[0].last_event_id


class Cluster:
    def __init__(self, bus: BusContext) -> None:
        self.bus = bus
        self.workers: dict[str, Worker] = {}
        self.feeds: list[KvRouterFeed] = []

    async def add_worker(self, instance: str, *, register: bool = True, ttl: float = 10.0,
                         model: str = "mock", **args: int) -> Worker:
        engine = MockerEngine({**ARGS, **args})
        await engine.start()
        pub = KvPublisherActor(self.bus.child(), instance, "agg", "mock", BS, engine.kv_event_sources(),
                               register=False)
        await pub.start()
        reg = None
        if register:
            reg = Registry(self.bus.js, self.bus.subjects.bucket_instances, ttl)
            await reg.ensure()
            await reg.register(instance, InstanceRecord(instance=instance, kind="engine", role="agg",
                                                        model=model, host="h", pid=1, block_size=BS))
        w = self.workers[instance] = Worker(instance, engine, pub, reg)
        return w

    async def feed(self, bus: BusContext | None = None, **kw) -> tuple[KvRouter, KvRouterFeed]:  # type: ignore[no-untyped-def]
        router = KvRouter(RouterConfig(block_size=BS))
        feed = KvRouterFeed(bus or self.bus, router, recovery_timeout=5.0, retry_interval=0.1, **kw)
        await feed.start()
        self.feeds.append(feed)
        return router, feed

    async def close(self) -> None:
        for f in self.feeds:
            await f.stop()
        for w in self.workers.values():
            if w.registry is not None:
                await w.registry.close()
            await w.pub.stop(0.5)
            await w.engine.shutdown()


@pytest.fixture
async def cluster(bus: BusContext) -> AsyncIterator[Cluster]:
    c = Cluster(bus)
    yield c
    await c.close()


def indexed(router: KvRouter, worker: Worker) -> set[int]:
    return set(router.index.worker_hashes((worker.instance, 0)))


async def converged(router: KvRouter, feed: KvRouterFeed, *workers: Worker) -> None:
    """Index == each publisher's own index (the ground truth of what was published)."""
    await eventually(lambda: all(router.index.last_event_id((w.instance, 0)) == w.last_event_id()
                                 and indexed(router, w) == w.blocks() for w in workers))
    await feed.wait_synced(5.0)


async def test_progressive_prefix_lands_on_one_worker(cluster: Cluster) -> None:
    a = await cluster.add_worker("wa")
    b = await cluster.add_worker("wb")
    router, feed = await cluster.feed()
    await eventually(lambda: feed.known_workers() == [("wa", 0), ("wb", 0)])
    base = list(range(1000, 1000 + 6 * BS))
    chosen: list[str] = []
    overlaps: list[int] = []
    for k in range(4):
        prompt = base[: (k + 2) * BS]  # 2, 3, 4, 5 blocks: each extends the previous by one
        d = router.route(prompt, feed.known_workers(), request_id=f"p{k}")
        chosen.append(d.instance)
        overlaps.append(d.overlap_blocks)
        w = cluster.workers[d.instance]
        await w.generate(prompt, f"p{k}")
        router.first_token(f"p{k}")
        router.finish(f"p{k}")
        await converged(router, feed, a, b)
    assert len(set(chosen)) == 1, chosen
    assert overlaps == [0, 2, 3, 4]
    # another prefix goes to the other (emptier) worker
    other = router.route(list(range(5000, 5000 + 3 * BS)), feed.known_workers())
    assert other.instance != chosen[0] and other.overlap_blocks == 0
    assert feed.counters["gaps"] == 0


async def test_gap_recovered_through_range(cluster: Cluster) -> None:
    w = await cluster.add_worker("wg", register=False)  # events only: no registry bootstrap dump
    router = KvRouter(RouterConfig(block_size=BS))
    feed = KvRouterFeed(cluster.bus, router, recovery_timeout=5.0, retry_interval=0.1)
    dropped: list[RouterKvEvent] = []
    deliver = feed.handle_event

    def lossy(ev: RouterKvEvent) -> None:  # the network "loses" event 1 once
        if ev.event_id == 1 and not dropped:
            dropped.append(ev)
            return
        deliver(ev)

    feed.handle_event = lossy  # type: ignore[method-assign]
    await feed.start()
    cluster.feeds.append(feed)
    for i in range(4):
        await w.generate([9, 9, 9, 9] + list(range(100 * i, 100 * i + 8)), f"g{i}")
    await converged(router, feed, w)
    assert dropped and feed.counters["gaps"] == 1
    assert feed.counters["ranges"] >= 1 and feed.counters["dumps"] == 0
    assert router.index.stats()["gaps"] == 1


async def test_late_feed_bootstraps_from_dump_without_losing_events(cluster: Cluster) -> None:
    w = await cluster.add_worker("wl")
    for i in range(5):
        await w.generate(list(range(10 * i, 10 * i + 12)), f"e{i}")
    await eventually(lambda: w.last_event_id() >= 4)

    async def traffic() -> None:  # events keep flowing while the late feed recovers
        for i in range(20):
            await w.generate([3, 3, 3, 3] + list(range(1000 + 10 * i, 1000 + 10 * i + 8)), f"t{i}")
            await asyncio.sleep(0.005)

    t = asyncio.create_task(traffic())
    router, feed = await cluster.feed()
    await t
    await converged(router, feed, w)
    assert feed.counters["dumps"] >= 1
    d = router.route(list(range(0, 12)), feed.known_workers())
    assert d.instance == "wl" and d.overlap_blocks == 3
    # without the registry, a late feed learns of the worker from its first event (id > 0): dump
    router2, feed2 = await cluster.feed(watch_registry=False)
    assert router2.index.workers() == []
    await w.generate(list(range(7000, 7012)), "x")
    await converged(router2, feed2, w)
    assert feed2.counters["dumps"] == 1 and feed2.counters["gaps"] == 1


async def test_worker_removed_on_deregistration_and_expiry(bus: BusContext, cluster: Cluster) -> None:
    # the bucket's TTL is fixed when it is created: create it with a short one for the expiry case
    await Registry(bus.js, bus.subjects.bucket_instances, 1.5).ensure()
    a = await cluster.add_worker("wr1", ttl=1.5)
    b = await cluster.add_worker("wr2", ttl=1.5)
    router, feed = await cluster.feed()
    await a.generate(list(range(40)), "a")
    await b.generate(list(range(40)), "b")
    await converged(router, feed, a, b)
    assert router.route(list(range(40)), feed.known_workers()).overlap_blocks == 10
    assert set(feed.block_sizes()) == {("wr1", 0), ("wr2", 0)}
    # load reports are reconciled too
    await bus.nc.publish(bus.subjects.load("wr1"), codec.encode(
        LoadReport(instance="wr1", num_running=3, num_waiting=1, kv_usage=0.5, active_kv_blocks=7,
                   total_kv_blocks=512), msgpack=True), headers=codec.headers_for(True))
    await eventually(lambda: feed.counters["load_reports"] == 1)
    assert router.load.kv_usage(("wr1", 0)) == 0.5
    # deregistration: gone at once
    assert a.registry is not None
    await a.registry.deregister("wr1")
    await eventually(lambda: ("wr1", 0) not in router.index.workers())
    assert feed.known_workers() == [("wr2", 0)] and indexed(router, b) == b.blocks()
    assert set(feed.block_sizes()) == {("wr2", 0)}  # the per-request caches follow the registry
    # a departed worker's stray events do not bring it back (e.g. its engine sleeps, deregistered)
    await a.generate(list(range(500, 520)), "stray")
    await eventually(lambda: feed.counters["events_ignored"] >= 1)
    assert ("wr1", 0) not in router.index.workers()
    # expiry: heartbeats stop, the server's TTL marker removes it
    assert b.registry is not None
    await b.registry.close()
    await eventually(lambda: router.index.workers() == [], timeout=10.0)
    assert feed.known_workers() == [] and len(router.index) == 0 and not feed.block_sizes()
    assert feed.counters["workers_removed"] == 2


async def test_two_feeds_converge_and_choose_alike(nats_server: EmbeddedNats, bus: BusContext,
                                                   cluster: Cluster) -> None:
    a = await cluster.add_worker("wc1")
    b = await cluster.add_worker("wc2")
    r1, f1 = await cluster.feed()
    shared = list(range(300, 300 + 4 * BS))
    await a.generate(shared + list(range(900, 908)), "a1")
    await b.generate(list(range(2000, 2000 + 2 * BS)), "b1")
    # a second "frontend": its own connection, started after that traffic
    bus2 = await open_context(nats_server.url, namespace=bus.namespace, host="h2", name="frontend-2")
    try:
        r2, f2 = await cluster.feed(bus2)
        await a.generate(list(range(600, 600 + 3 * BS)), "a2")
        await b.generate(shared[: 2 * BS] + list(range(4000, 4008)), "b2")
        await converged(r1, f1, a, b)
        await converged(r2, f2, a, b)
        assert r1.index.stats()["blocks"] == r2.index.stats()["blocks"]
        req = shared + list(range(50, 58))
        d1 = r1.route(req, f1.known_workers(), request_id="q")
        d2 = r2.route(req, f2.known_workers(), request_id="q")
        assert (d1.instance, d1.overlap_blocks, d1.cost) == (d2.instance, d2.overlap_blocks, d2.cost)
        assert d1.instance == "wc1" and d1.overlap_blocks == 4
        assert [(c.instance, c.overlap_blocks) for c in d1.costs] == \
               [(c.instance, c.overlap_blocks) for c in d2.costs]
        assert hashing.sequence_hashes(req, BS)[0] in indexed(r2, a)
    finally:
        await f2.stop()
        cluster.feeds.remove(f2)
        await bus2.close()


async def test_removed_and_cleared_blocks_leave_the_index(cluster: Cluster) -> None:
    w = await cluster.add_worker("we", num_gpu_blocks=12, max_model_len=48)  # tiny pool: later prompts evict earlier ones
    router, feed = await cluster.feed()
    first = list(range(10, 10 + 4 * BS))
    await w.generate(first, "f")
    await converged(router, feed, w)
    assert set(hashing.sequence_hashes(first, BS)) <= indexed(router, w)
    for i in range(4):
        await w.generate(list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * BS)), f"e{i}")
    await converged(router, feed, w)
    assert not set(hashing.sequence_hashes(first, BS)) & indexed(router, w)  # evicted → removed
    assert router.index.stats()["events_applied"] > 5
    assert await w.engine.reset_prefix_cache()
    await eventually(lambda: w.blocks() == set())
    await converged(router, feed, w)
    assert indexed(router, w) == set() and len(router.index) == 0


async def test_publisher_restart_is_a_new_epoch(cluster: Cluster) -> None:
    w = await cluster.add_worker("wp")
    router, feed = await cluster.feed()
    await w.generate(list(range(1, 17)), "a")
    await w.generate(list(range(100, 116)), "b")
    await converged(router, feed, w)
    old_epoch = w.pub.translators[0].epoch
    # the worker supervisor restarts the publisher alone (same engine, same process metrics)
    await w.pub.stop(0.5)
    w.pub = KvPublisherActor(cluster.bus.child(), "wp", "agg", "mock", BS, w.engine.kv_event_sources(),
                             register=False, metrics=w.pub.kv_metrics)
    await w.pub.start()
    assert w.pub.translators[0].epoch != old_epoch
    # it replays the engine's ZMQ history from seq 0 and renumbers from event 0
    await eventually(lambda: w.blocks() >= set(hashing.sequence_hashes(list(range(1, 17)), BS)))
    await w.generate(list(range(1, 13)) + [7, 7, 7, 7], "c")
    await converged(router, feed, w)
    assert router.route(list(range(100, 116)), feed.known_workers()).overlap_blocks == 4


async def test_model_filter_indexes_only_that_models_workers(cluster: Cluster) -> None:
    a = await cluster.add_worker("wm1", model="m1")
    b = await cluster.add_worker("wm2", model="m2")
    router, feed = await cluster.feed(model="m1")
    late = await cluster.add_worker("wm3", model="m1")  # registers after the feed started
    for w in (a, b, late):
        await w.generate(list(range(60, 80)), f"r-{w.instance}")
    await converged(router, feed, a, late)
    assert feed.known_workers() == [("wm1", 0), ("wm3", 0)]
    assert ("wm2", 0) not in router.index.workers() and feed.counters["events_ignored"] >= 1


async def test_joining_worker_bootstraps_without_touching_the_others(cluster: Cluster) -> None:
    a = await cluster.add_worker("wj1")
    b = await cluster.add_worker("wj2")
    router, feed = await cluster.feed()
    await a.generate(list(range(100, 100 + 4 * BS)), "a")
    await b.generate(list(range(200, 200 + 3 * BS)), "b")
    await converged(router, feed, a, b)
    # a decision whose blocks no event has confirmed yet (booked as predicted blocks)
    pending = list(range(900, 900 + 5 * BS))
    d = router.route(pending, [("wj1", 0), ("wj2", 0)], request_id="p")
    router.finish("p")  # its load is gone, its blocks stay predicted
    before = {w: indexed(router, cluster.workers[w]) for w in ("wj1", "wj2")}
    predicted = router.stats()["predicted"]["blocks"]
    assert predicted == 5 and before["wj1"] and before["wj2"]
    dumps = feed.counters["dumps"]
    # a third worker with a cache of its own registers: the feed bootstraps it from its dump
    c = await cluster.add_worker("wj3", register=False)
    await c.generate(list(range(300, 300 + 2 * BS)), "c")
    reg = Registry(cluster.bus.js, cluster.bus.subjects.bucket_instances)
    c.registry = reg
    await reg.ensure()
    await reg.register("wj3", InstanceRecord(instance="wj3", kind="engine", role="agg", model="mock",
                                             host="h", pid=1, block_size=BS))
    await eventually(lambda: feed.counters["dumps"] == dumps + 1)  # only the newcomer is dumped
    await converged(router, feed, a, b, c)
    assert feed.counters["dumps"] == dumps + 1 and feed.known_workers()[-1] == ("wj3", 0)
    assert indexed(router, c) == c.blocks() and len(c.blocks()) == 2
    assert {w: indexed(router, cluster.workers[w]) for w in ("wj1", "wj2")} == before
    assert router.stats()["predicted"]["blocks"] == predicted
    assert router.route(pending, feed.known_workers(), book=False).overlap_blocks == 5
    assert router.route(pending, feed.known_workers(), book=False).instance == d.instance


async def test_router_used_before_its_feed_keeps_its_decisions(cluster: Cluster) -> None:
    a = await cluster.add_worker("wf1")
    b = await cluster.add_worker("wf2")
    await a.generate(list(range(10, 10 + 3 * BS)), "a")
    await b.generate(list(range(20, 20 + 3 * BS)), "b")
    # the frontend routes before its feed is up (the router is built from the registry's block size)
    router = KvRouter(RouterConfig(block_size=BS))
    early = list(range(700, 700 + 4 * BS))
    d = router.route(early, [("wf1", 0), ("wf2", 0)], request_id="e")
    router.finish("e")
    feed = KvRouterFeed(cluster.bus, router, recovery_timeout=5.0, retry_interval=0.1)
    await feed.start()
    cluster.feeds.append(feed)
    await converged(router, feed, a, b)
    # the bootstrap dumps merged into the router: both workers' caches, and the early decision
    assert feed.counters["dumps"] == 2
    assert router.stats()["predicted"]["blocks"] == 4
    again = router.route(early + [1] * BS, feed.known_workers(), book=False)
    assert again.instance == d.instance and again.overlap_blocks == 4
    # the chosen worker then really stores them: the events confirm the prediction
    await cluster.workers[d.instance].generate(early, "e")
    await converged(router, feed, a, b)
    assert router.stats()["predicted"]["blocks"] == 0
    assert router.route(early, feed.known_workers(), book=False).overlap_blocks == 4


async def test_garbage_on_the_event_subject_is_counted_not_raised(bus: BusContext, cluster: Cluster) -> None:
    """Anyone on the bus can publish on ns.kv.events.*: undecodable events (deep nesting, invalid
    UTF-8, msgpack garbage) are counted; the feed goes on indexing real events."""
    a = await cluster.add_worker("wg")
    router, feed = await cluster.feed()
    await eventually(lambda: feed.known_workers() == [("wg", 0)])
    subject = bus.subjects.kv_events("wg")
    for data, headers in ((b"[" * 100_000 + b"]" * 100_000, None), (b'{"instance": "\xff"}', None),
                          (b"\xc1\xc1", {"Content-Type": "application/msgpack"}),
                          (b"\x91" * 5000 + b"\xc0", {"Content-Type": "application/msgpack"}),
                          # a batch header over one event, and over a batch with one bad event
                          (encode_event(RouterKvEvent(instance="wg", event_id=0, kind="cleared", block_size=BS)),
                           {"Content-Type": "application/msgpack", "Kv-Batch": "1"}),
                          (b'[{"instance": "wg", "event_id": 0, "kind": "cleared", "block_size": 4}, {"x": 1}]',
                           {"Kv-Batch": "2"})):
        await bus.nc.publish(subject, data, headers=headers)
    await eventually(lambda: feed.counters["decode_errors"] == 6)
    await a.generate(list(range(2000, 2000 + 3 * BS)), "after-garbage")
    await converged(router, feed, a)


async def test_a_batch_message_is_applied_event_by_event_in_order(bus: BusContext, cluster: Cluster) -> None:
    """One message with ``Kv-Batch: n`` (what one engine step changed) is n events to the feed, in
    order; JSON works as msgpack does (``nats pub`` with the header)."""
    router, feed = await cluster.feed()  # no model filter: it indexes any instance's events
    h1, h2, h3 = 0x101, 0x102, 0x103
    first = [RouterKvEvent(instance="wb", event_id=0, kind="stored", block_size=BS,
                           stored=[StoredBlock(h1), StoredBlock(h2, h1)]),
             RouterKvEvent(instance="wb", event_id=1, kind="stored", block_size=BS,
                           stored=[StoredBlock(h3, h2)])]
    await bus.nc.publish(bus.subjects.kv_events("wb"), encode_batch([encode_event(e) for e in first]),
                         headers={S.CONTENT_TYPE: S.CT_MSGPACK, S.KV_BATCH: "2"})
    await eventually(lambda: set(router.index.worker_hashes(("wb", 0))) == {h1, h2, h3})
    second = msgspec.json.encode([RouterKvEvent(instance="wb", event_id=2, kind="removed", block_size=BS,
                                                removed=[h3]),
                                  RouterKvEvent(instance="wb", event_id=3, kind="removed", block_size=BS,
                                                removed=[h2])])
    await bus.nc.publish(bus.subjects.kv_events("wb"), second, headers={S.KV_BATCH: "2"})
    await eventually(lambda: set(router.index.worker_hashes(("wb", 0))) == {h1})
    assert router.index.last_event_id(("wb", 0)) == 3
    assert feed.counters["events"] == 4 and feed.counters["gaps"] == 0 and feed.counters["decode_errors"] == 0
