"""The parts of a frontend that runs as several processes, each against the real thing: connections
handed over real sockets, bookings and quarantine over a real nats-server, /metrics merged from real
expositions. (The processes themselves, through the CLI: tests/e2e/test_frontend_processes.py.)"""

from __future__ import annotations

import asyncio
import random
import re
import socket
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from actors.frontend import metrics_merge
from actors.frontend.handoff import HandedConnections
from actors.frontend.quarantine import Quarantine, QuarantinedRequest
from actors.frontend.shared_quarantine import SharedQuarantine
from actors.frontend.shared_view import SharedRoutingView
from actors.router.cost import RouterConfig
from actors.router.kv_router import KvRouter
from bus.connection import flush_in_order
from bus.context import BusContext, open_context
from deploy.frontends import ConnectionDispatcher, HttpListener

WORKERS = [("w0", 0), ("w1", 0)]


async def until(pred: Callable[[], object], timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


@pytest.fixture
async def peer(bus: BusContext, nats_server) -> BusContext:  # type: ignore[no-untyped-def]
    """A second connection on the same namespace: another frontend process."""
    ctx = await open_context(nats_server.url, namespace=bus.subjects.ns, host="testhost", name="peer")
    yield ctx  # type: ignore[misc]
    await ctx.close()


# --- connections handed over by the root ----------------------------------------------------------
class Named(asyncio.Protocol):
    def __init__(self, name: str) -> None:
        self.name = name

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.name.encode())
        transport.close()


async def fetch(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return (await asyncio.wait_for(reader.read(), 5)).decode()
    finally:
        writer.close()


async def test_the_root_hands_connections_to_ready_processes_in_turn() -> None:
    listener = HttpListener("127.0.0.1:0")
    d = ConnectionDispatcher(listener)
    port = listener.socket().getsockname()[1]
    _, a_end = d.pair("a")
    _, b_end = d.pair("b")
    a = HandedConnections(a_end, lambda: Named("a"))
    b = HandedConnections(b_end, lambda: Named("b"))
    try:
        # no process ready: the connection waits in the backlog, and is served once one is
        waiting = asyncio.create_task(fetch(port))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        a.start()
        assert await waiting == "a"
        b.start()
        await until(lambda: sum(link.ready for link in d._links) == 2)
        got = await asyncio.gather(*(fetch(port) for _ in range(20)))
        assert sorted(got).count("a") == 10 and got.count("b") == 10  # exact turns
        # a process that stops its frontend actor is sent nothing until it is ready again
        a.stop()
        await until(lambda: sum(link.ready for link in d._links) == 1)
        assert set(await asyncio.gather(*(fetch(port) for _ in range(6)))) == {"b"}
        # a process that dies (its end closed): the root drops it at once, the others take all
        b.stop()
        b_end.close()
        a.start()
        await until(lambda: len(d._links) == 1)
        assert set(await asyncio.gather(*(fetch(port) for _ in range(6)))) == {"a"}
    finally:
        d.close()
        listener.close()


def test_a_taken_address_fails_loudly() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        listener = HttpListener(f"127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(OSError):
            listener.socket()


# --- bookings over the bus ------------------------------------------------------------------------
async def test_bookings_cross_the_bus_and_a_malformed_batch_is_dropped(bus: BusContext, peer: BusContext) -> None:
    ra = KvRouter(RouterConfig(block_size=4), rng=random.Random(0))
    rb = KvRouter(RouterConfig(block_size=4), rng=random.Random(0))
    va, vb = SharedRoutingView(bus, ra, "fa"), SharedRoutingView(peer, rb, "fb")
    await va.start()
    await vb.start()
    try:
        await bus.nc.publish(bus.subjects.router_bookings("junk"), b"\x93not a batch")
        d = ra.route(list(range(32)), WORKERS, request_id="r1", session="s1")
        await until(lambda: rb.load.running(d.worker) == 1)
        assert rb.sessions.bound("s1") == d.worker and vb.remote.stats() == {"fa": 1}
        ra.first_token("r1")
        ra.finish("r1")
        await until(lambda: rb.load.running(d.worker) == 0)
        assert ra.load.running(d.worker) == 0 and vb.remote.applied >= 2
    finally:
        await va.stop()
        await vb.stop()


# --- quarantine over the bus ----------------------------------------------------------------------
async def test_a_quarantine_reaches_every_frontend_and_one_started_later(bus: BusContext, peer: BusContext) -> None:
    qa, qb = Quarantine(ttl=30), Quarantine(ttl=30)
    sa, sb = SharedQuarantine(bus, qa, "fa"), SharedQuarantine(peer, qb, "fb")
    await sa.start()
    await sb.start()
    sc: SharedQuarantine | None = None
    try:
        qa.add("fp1", "req-1", ["w0", "w1"])
        await until(lambda: len(qb) == 1)
        with pytest.raises(QuarantinedRequest):
            qb.check("fp1")
        assert qb.total == 0  # refused there, but quarantined (and counted) by the one that saw the deaths
        qc = Quarantine(ttl=30)
        sc = SharedQuarantine(peer, qc, "fc")  # a process that (re)starts afterwards
        await sc.start()
        with pytest.raises(QuarantinedRequest):
            qc.check("fp1")
        # an operator lifts it (nats kv del <ns>-quarantine fp1): refused nowhere any more
        kv = await bus.js.key_value(bus.subjects.bucket_quarantine)
        await kv.delete("fp1")
        await until(lambda: len(qa) == 0 and len(qb) == 0 and len(qc) == 0)
        qa.check("fp1")
    finally:
        for s in (sa, sb, sc):
            if s is not None:
                await s.stop()


# --- /metrics of every process ---------------------------------------------------------------------
def exposition(requests: float, latency: float) -> bytes:
    r = CollectorRegistry()
    Counter("vllm_actors_frontend_requests", "HTTP requests", ["endpoint"], registry=r).labels("chat").inc(requests)
    Histogram("frontend_ttft_seconds", "TTFT", registry=r, buckets=[0.1, 1.0]).observe(latency)
    return generate_latest(r)


def samples(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}\{{.*?frontend="([^"]+)".*?\}} (\S+)$', text, re.M)}


def test_merge_labels_each_process_and_keeps_every_series() -> None:
    text = metrics_merge.merge([("p0", exposition(3, 0.05)), ("p1", exposition(4, 0.5))]).decode()
    assert samples(text, "vllm_actors_frontend_requests_total") == {"p0": 3.0, "p1": 4.0}
    assert samples(text, "frontend_ttft_seconds_count") == {"p0": 1.0, "p1": 1.0}
    assert text.count("# TYPE vllm_actors_frontend_requests_total counter") == 1  # one family, both processes
    assert re.search(r"^vllm_actors_frontend_scrape_missing 0\.0$", text, re.M)


async def test_gather_asks_every_process_over_the_bus(bus: BusContext, peer: BusContext) -> None:
    subject = bus.subjects.frontend_scrape()

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        await peer.nc.publish(msg.reply, metrics_merge.encode_part("p1", exposition(5, 0.5)))

    sub = await peer.nc.subscribe(subject, cb=answer)
    await flush_in_order(peer.nc)
    try:
        # returns once both answered (the timeout only bounds a loaded box's wait)
        text = (await metrics_merge.gather(bus.nc, subject, "p0", exposition(2, 0.05), expected=1,
                                           timeout=10.0)).decode()
        assert samples(text, "vllm_actors_frontend_requests_total") == {"p0": 2.0, "p1": 5.0}
        # one process more than answers: it is reported missing, after the timeout
        text = (await metrics_merge.gather(bus.nc, subject, "p0", exposition(2, 0.05), expected=2,
                                           timeout=0.3)).decode()
        assert re.search(r"^vllm_actors_frontend_scrape_missing 1\.0$", text, re.M)
    finally:
        await sub.unsubscribe()
