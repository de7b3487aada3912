"""Streaming RPC against a real nats-server: order, cancel, caller gone, stalls, gaps, errors."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bus import codec
from bus import subjects as S
from bus.context import BusContext
from bus.errors import BadRequest, RemoteError, ResponderGone, StreamGap, StreamStalled, Unavailable
from bus.stream import stream_request
from bus.stream_responder import StreamCancels, request_id, respond_stream

ROOT = Path(__file__).resolve().parents[2]


class Responder:
    """A raw streaming responder (no Actor) recording how its generator ended."""

    def __init__(self, bus: BusContext, subject: str, cancel_subject: str | None) -> None:
        self.bus, self.subject, self.cancel_subject = bus, subject, cancel_subject
        self.cancels = StreamCancels()
        self.closed = asyncio.Event()
        self.completed = False
        self.sent = 0

    async def gen(self, n: int, interval: float) -> AsyncIterator[dict[str, int]]:
        try:
            for i in range(n):
                if interval:
                    await asyncio.sleep(interval)
                self.sent += 1
                yield {"i": i}
            self.completed = True
        finally:
            self.closed.set()

    async def start(self) -> None:
        async def on_req(msg):  # type: ignore[no-untyped-def]
            req = codec.decode(msg.data, msg.headers)
            task = asyncio.ensure_future(respond_stream(
                self.bus.nc, msg, self.gen(req["n"], req.get("interval", 0.0)),
                cancel_subject=self.cancel_subject, instance="inst-1"))
            self.cancels.track(request_id(msg), task)

        await self.bus.nc.subscribe(self.subject, cb=on_req)
        if self.cancel_subject:
            await self.bus.nc.subscribe(self.cancel_subject, cb=self.cancels.handle)
        await self.bus.nc.flush()


@pytest.fixture
async def responder(bus: BusContext) -> Responder:
    r = Responder(bus, bus.subjects.echo("rawstream"), bus.subjects.actor("raw", "inst-1", "cancel"))
    await r.start()
    return r


async def test_10000_chunks_in_order(bus: BusContext, responder: Responder) -> None:
    call = stream_request(bus.nc, responder.subject, {"n": 10_000})
    got = [c["i"] async for c in call]
    assert got == list(range(10_000))
    assert call.instance == "inst-1" and call.received == 10_000
    assert responder.completed


async def test_no_responders_fails_at_once(bus: BusContext) -> None:
    with pytest.raises(Unavailable):
        async for _ in stream_request(bus.nc, bus.subjects.echo("nobody-here"), {}, stall_timeout=30):
            pass


async def test_aclose_publishes_cancel(bus: BusContext, responder: Responder) -> None:
    call = stream_request(bus.nc, responder.subject, {"n": 1000, "interval": 0.02})
    async for c in call:
        if c["i"] == 2:
            break
    await call.aclose()
    await asyncio.wait_for(responder.closed.wait(), 5)
    assert responder.cancels.cancelled == 1
    assert not responder.completed and responder.sent < 1000


async def test_break_and_drop_cancels(bus: BusContext, responder: Responder) -> None:
    call = stream_request(bus.nc, responder.subject, {"n": 1000, "interval": 0.02})
    async for _ in call:
        break
    del call
    gc.collect()  # the generator's finaliser runs aclose() on the loop
    await asyncio.wait_for(responder.closed.wait(), 5)
    assert not responder.completed


async def test_cancelled_consumer_task_cancels(bus: BusContext, responder: Responder) -> None:
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in stream_request(bus.nc, responder.subject, {"n": 1000, "interval": 0.02}):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(responder.closed.wait(), 5)
    assert responder.cancels.cancelled == 1


async def test_caller_gone_without_cancel_subject_stops_generator(bus: BusContext) -> None:
    # No cancel subject advertised: the responder must notice the inbox vanished (503 on its reply).
    r = Responder(bus, bus.subjects.echo("nocancel"), None)
    await r.start()
    call = stream_request(bus.nc, r.subject, {"n": 1000, "interval": 0.02}, stall_timeout=0.6)
    async for _ in call:
        break
    await call.aclose()
    await asyncio.wait_for(r.closed.wait(), 5)
    assert not r.completed and r.cancels.cancelled == 0


async def test_heartbeats_keep_a_slow_stream_alive(bus: BusContext, responder: Responder) -> None:
    # 1.2 s between chunks > 0.8 s stall timeout: only heartbeats (every ~0.27 s) keep it alive.
    # (0.5 s / 0.4 s left the caller's liveness probe ~0.25 s to be answered: too little on a loaded
    # 2-core CI machine, where it failed twice.)
    got = [c["i"] async for c in stream_request(bus.nc, responder.subject, {"n": 3, "interval": 1.2},
                                                 stall_timeout=0.8)]
    assert got == [0, 1, 2]


async def test_gap_detected(bus: BusContext) -> None:
    subj = bus.subjects.echo("gappy")

    async def on_req(msg):  # type: ignore[no-untyped-def]
        for seq in (1, 3):
            await bus.nc.publish(msg.reply, codec.encode({"i": seq}), headers={S.SEQ: str(seq)})

    await bus.nc.subscribe(subj, cb=on_req)
    await bus.nc.flush()
    got = []
    with pytest.raises(StreamGap):
        async for c in stream_request(bus.nc, subj, {}, msgpack=False):
            got.append(c)
    assert got == [{"i": 1}]


async def test_error_message_is_typed(bus: BusContext) -> None:
    subj = bus.subjects.echo("erring")

    async def gen() -> AsyncIterator[dict[str, int]]:
        yield {"i": 0}
        raise BadRequest("bad thing")

    async def on_req(msg):  # type: ignore[no-untyped-def]
        asyncio.ensure_future(respond_stream(bus.nc, msg, gen()))

    await bus.nc.subscribe(subj, cb=on_req)
    await bus.nc.flush()
    got = []
    with pytest.raises(BadRequest, match="bad thing"):
        async for c in stream_request(bus.nc, subj, {}):
            got.append(c)
    assert got == [{"i": 0}]

    async def gen500() -> AsyncIterator[dict[str, int]]:
        for item in ():  # a generator that raises before its first item
            yield item
        raise KeyError("oops")

    subj2 = bus.subjects.echo("erring500")

    async def on_req2(msg):  # type: ignore[no-untyped-def]
        asyncio.ensure_future(respond_stream(bus.nc, msg, gen500()))

    await bus.nc.subscribe(subj2, cb=on_req2)
    await bus.nc.flush()
    with pytest.raises(RemoteError) as ei:
        async for _ in stream_request(bus.nc, subj2, {}):
            pass
    assert ei.value.code == 500


RESPONDER = r"""
import asyncio, sys
from bus.connection import connect, flush_in_order
from bus.rpc import respond_stream

async def main(url, subject):
    nc = await connect(url, "killable-responder")
    async def gen():
        i = 0
        while True:
            yield {"i": i}
            i += 1
            await asyncio.sleep(0.05)
    async def on_req(msg):
        asyncio.ensure_future(respond_stream(nc, msg, gen(), instance="victim"))
    await nc.subscribe(subject, cb=on_req)
    await flush_in_order(nc)  # live before the test's own connection sends a request
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def _victim(nats_url: str, subj: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", RESPONDER, nats_url, subj], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE)
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
    assert line.strip() == b"ready"
    return proc


async def test_killed_responder_process_is_a_stall(bus: BusContext, nats_server) -> None:  # type: ignore[no-untyped-def]
    """A SIGKILLed responder has no subscriptions left: the caller's liveness probe finds that out
    about one heartbeat interval after the stream went quiet, not a whole stall timeout later."""
    subj = bus.subjects.echo("victim")
    proc = await _victim(nats_server.url, subj)
    try:
        stall = 6.0
        call = stream_request(bus.nc, subj, {}, stall_timeout=stall)
        seen = 0
        killed_at = 0.0
        with pytest.raises(StreamStalled, match="responder gone"):
            async for _ in call:
                seen += 1
                if seen == 5:
                    proc.kill()
                    killed_at = time.monotonic()
        assert call.instance == "victim"
        assert time.monotonic() - killed_at < stall  # found by the probe, before the stall timeout
    finally:
        proc.kill()
        proc.wait()


async def test_hung_responder_gets_the_full_stall_timeout(bus: BusContext, nats_server) -> None:  # type: ignore[no-untyped-def]
    """A frozen (SIGSTOPped) responder still holds its subscriptions: the probe cannot tell, so the
    stall timeout decides."""
    subj = bus.subjects.echo("frozen")
    proc = await _victim(nats_server.url, subj)
    try:
        stall = 1.5
        call = stream_request(bus.nc, subj, {}, stall_timeout=stall)
        seen = 0
        stopped_at = 0.0
        with pytest.raises(StreamStalled, match="stalled: nothing for"):
            async for _ in call:
                seen += 1
                if seen == 5:
                    proc.send_signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
        assert time.monotonic() - stopped_at >= stall * 0.8
    finally:
        proc.kill()
        proc.wait()


async def test_a_caller_that_stood_still_reads_what_arrived_before_it_judges_a_stall(  # type: ignore[no-untyped-def]
        bus: BusContext, nats_server) -> None:
    """The caller's process stands still for longer than the stall timeout (a blocking call here; a
    starved CPU or a GC pause in production) while the responder keeps streaming. When it runs again
    the wait's timer is overdue and the chunks sent meanwhile are still unread in its socket: they
    are read before silence is judged, so the stream goes on, in order, with no StreamStalled."""
    subj = bus.subjects.echo("steady")
    proc = await _victim(nats_server.url, subj)
    stall = 1.0

    async def stand_still() -> None:
        await asyncio.sleep(0.01)  # the consumer is now waiting for its next chunk, its timer armed
        time.sleep(stall * 1.5)

    try:
        call = stream_request(bus.nc, subj, {}, stall_timeout=stall)
        got: list[int] = []
        blocker: asyncio.Future[None] | None = None
        async for chunk in call:
            got.append(chunk["i"])
            if len(got) == 3:
                blocker = asyncio.ensure_future(stand_still())
            if len(got) == 10:
                break
        await call.aclose()
        assert blocker is not None
        await blocker
        assert got == list(range(10))
    finally:
        proc.kill()
        proc.wait()


async def test_calls_share_one_inbox_subscription(bus: BusContext, responder: Responder) -> None:
    """A stream call is a single PUB: every call on a connection uses one wildcard inbox
    subscription, so the connection's subscription count does not grow with calls."""
    got = [c["i"] async for c in stream_request(bus.nc, responder.subject, {"n": 2})]
    assert got == [0, 1]
    subs = len(bus.nc._subs)
    calls = [stream_request(bus.nc, responder.subject, {"n": 3, "interval": 0.05}) for _ in range(20)]
    firsts = await asyncio.gather(*(c.__anext__() for c in calls))  # all 20 calls are open now
    assert [f["i"] for f in firsts] == [0] * 20
    assert len(bus.nc._subs) == subs

    async def drain(call):  # type: ignore[no-untyped-def]
        return [c["i"] async for c in call]

    results = await asyncio.gather(*(drain(c) for c in calls))
    assert results == [[1, 2]] * 20
    assert len(bus.nc._subs) == subs


CALLER = r"""
import asyncio, sys
from bus.connection import connect
from bus.stream import stream_request

async def main(url, subject):
    nc = await connect(url, "killable-caller")
    async for _ in stream_request(nc, subject, {"n": 100000, "interval": 0.02}, stall_timeout=0.6):
        print("chunk", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_killed_caller_process_stops_the_responder(bus: BusContext, nats_server) -> None:  # type: ignore[no-untyped-def]
    """A SIGKILLed caller takes its inbox subscription with it: the server answers the responder's
    next chunk with "no responders" and the generator is closed."""
    r = Responder(bus, bus.subjects.echo("callervictim"), None)
    await r.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CALLER, nats_server.url, r.subject], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        assert line.strip() == b"chunk"
        proc.kill()
        await asyncio.wait_for(r.closed.wait(), 5)
        assert not r.completed
    finally:
        proc.kill()
        proc.wait()


async def test_closing_the_connection_ends_open_calls(nats_server, responder: Responder) -> None:  # type: ignore[no-untyped-def]
    """Calls waiting on the shared inbox fail at once when their connection closes (as a
    per-call subscription's next_msg did), instead of waiting out the stall timeout."""
    import nats.errors

    from bus.connection import connect

    nc = await connect(nats_server.url, "closing-caller")
    call = stream_request(nc, responder.subject, {"n": 1000, "interval": 0.2}, stall_timeout=30)
    assert (await call.__anext__())["i"] == 0
    t0 = time.monotonic()
    closer = asyncio.create_task(nc.close())
    with pytest.raises(nats.errors.ConnectionClosedError):
        await call.__anext__()
    await closer
    assert time.monotonic() - t0 < 10


async def test_a_stream_its_live_responder_dropped_is_found_by_the_probe(bus: BusContext,
                                                                         responder: Responder) -> None:
    """The responder's process lives on but dropped the stream (it took the caller for gone during
    a bus restart): the probe's answer says so, and the caller does not wait out the stall timeout."""
    stall = 6.0
    call = stream_request(bus.nc, responder.subject, {"n": 1000, "interval": 0.02}, stall_timeout=stall)
    seen = 0
    dropped_at = 0.0
    with pytest.raises(ResponderGone):
        async for _ in call:
            seen += 1
            if seen == 5:
                assert responder.cancels.cancel(call.request_id)  # the responder side ends it, silently
                dropped_at = time.monotonic()
    assert time.monotonic() - dropped_at < stall
