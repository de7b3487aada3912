"""Batched stream messages (bus.stream_batch) against a real nats-server: what many streams of one
responder produce in one loop turn reaches a batching caller as one message per turn, in order,
while plain callers, closed calls and vanished callers behave as with one message per chunk."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from bus import codec
from bus import subjects as S
from bus.connection import connect
from bus.context import BusContext
from bus.stream import _inbox_mux, stream_request
from bus.stream_batch import BATCH_DECODER
from bus.stream_responder import _mux, respond_stream

ROOT = Path(__file__).resolve().parents[2]


class Stepper:
    """An engine's step loop in miniature: every ``interval`` one step, and every stream running
    gets its next chunk in the same loop turn (as vLLM's output handler wakes every request)."""

    def __init__(self, bus: BusContext, subject: str, interval: float = 0.01) -> None:
        self.bus, self.subject, self.interval = bus, subject, interval
        self.step = asyncio.Event()
        self.closed: dict[int, asyncio.Event] = {}
        self.completed: set[int] = set()
        self._task: asyncio.Task[None] | None = None

    async def gen(self, sid: int, n: int) -> AsyncIterator[dict[str, int]]:
        try:
            for i in range(n):
                ev = self.step
                await ev.wait()
                yield {"s": sid, "i": i}
            self.completed.add(sid)
        finally:
            self.closed[sid].set()

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            ev, self.step = self.step, asyncio.Event()
            ev.set()

    async def start(self) -> None:
        async def on_req(msg):  # type: ignore[no-untyped-def]
            req = codec.decode(msg.data, msg.headers)
            self.closed[req["s"]] = asyncio.Event()
            asyncio.ensure_future(respond_stream(self.bus.nc, msg, self.gen(req["s"], req["n"]), instance="i1"))

        await self.bus.nc.subscribe(self.subject, cb=on_req)
        await self.bus.nc.flush()
        self._task = asyncio.ensure_future(self._steps())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


@pytest.fixture
async def stepper(bus: BusContext) -> AsyncIterator[Stepper]:
    s = Stepper(bus, bus.subjects.echo("stepper"))
    await s.start()
    yield s
    s.stop()


async def _drain(call) -> list[int]:  # type: ignore[no-untyped-def]
    return [c["i"] async for c in call]


async def test_many_streams_arrive_whole_and_in_order_in_far_fewer_messages(
        nats_server, bus: BusContext, stepper: Stepper) -> None:  # type: ignore[no-untyped-def]
    nc = await connect(nats_server.url, "batching-caller")
    try:
        before = nc.stats["in_msgs"]
        calls = [stream_request(nc, stepper.subject, {"s": s, "n": 30}) for s in range(16)]
        results = await asyncio.gather(*(_drain(c) for c in calls))
        assert results == [list(range(30))] * 16
        assert {c.instance for c in calls} == {"i1"}  # the first piece's headers arrived too
        received = nc.stats["in_msgs"] - before
        # 16 x (30 chunks + eos) = 496 stream messages; batched per step they are ~31-62 NATS messages
        assert received < 16 * 31 / 4, received
        assert _mux(bus.nc).outbox.batches > 0
    finally:
        await nc.close()


async def test_a_caller_that_did_not_ask_gets_plain_messages(bus: BusContext, stepper: Stepper) -> None:
    """nats req / a plain subscriber: no Stream-Batch header, so one message per chunk as always."""
    nc = bus.nc
    inbox = nc.new_inbox()
    got: list[tuple[str, dict[str, str]]] = []
    done = asyncio.Event()

    async def on_msg(msg):  # type: ignore[no-untyped-def]
        got.append((msg.subject, dict(msg.headers or {})))
        if (msg.headers or {}).get(S.STREAM_CONTROL) == S.EOS:
            done.set()

    subs = [await nc.subscribe(inbox + ".*", cb=on_msg)]
    for s in range(4):
        await nc.publish(stepper.subject, codec.encode({"s": s, "n": 5}), reply=f"{inbox}.{s}",
                         headers={S.CONTENT_TYPE: S.CT_JSON})
    try:
        for _ in range(100):
            if sum(1 for _, h in got if h.get(S.STREAM_CONTROL) == S.EOS) == 4:
                break
            await asyncio.sleep(0.05)
        assert all(not subj.endswith("." + S.BATCH_TOKEN) for subj, _ in got)
        chunks = [h for _, h in got if S.STREAM_CONTROL not in h]
        assert len(chunks) == 20 and all(S.SEQ in h for h in chunks)
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def test_a_closed_call_is_answered_gone_inside_batches(nats_server, bus: BusContext,
                                                            stepper: Stepper) -> None:  # type: ignore[no-untyped-def]
    """No cancel subject: the only way the responder learns that one call of a batching caller is
    over is the caller's "gone" answer to that call's pieces; the other streams run to the end."""
    nc = await connect(nats_server.url, "closing-one")
    try:
        calls = [stream_request(nc, stepper.subject, {"s": s, "n": 200}) for s in range(6)]
        assert (await calls[0].__anext__())["i"] == 0
        await calls[0].aclose()
        await asyncio.wait_for(stepper.closed[0].wait(), 5)
        assert 0 not in stepper.completed
        results = await asyncio.gather(*(_drain(c) for c in calls[1:]))
        assert results == [list(range(200))] * 5
    finally:
        await nc.close()


async def test_garbage_on_the_batch_subject_breaks_no_call(nats_server, bus: BusContext, stepper: Stepper,
                                                           caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    nc = await connect(nats_server.url, "garbage-target")
    try:
        calls = [stream_request(nc, stepper.subject, {"s": s, "n": 20}) for s in range(3)]
        await calls[0].__anext__()
        prefix = _inbox_mux(nc).prefix
        with caplog.at_level(logging.WARNING, logger="bus.stream"):
            for junk in (b"", b"\xc1", msgspec.msgpack.encode([["x"]]), msgspec.msgpack.encode({"a": 1})):
                await bus.nc.publish(prefix + S.BATCH_TOKEN, junk)
            await bus.nc.flush()
            rest = await asyncio.gather(*(_drain(c) for c in calls))
        assert rest == [list(range(1, 20))] + [list(range(20))] * 2
        assert "undecodable stream batch" in caplog.text
        with pytest.raises(msgspec.DecodeError):
            BATCH_DECODER.decode(b"\xc1")
    finally:
        await nc.close()


CALLER = r"""
import asyncio, sys
from bus.connection import connect
from bus.stream import _inbox_mux, stream_request

async def main(url, subject):
    nc = await connect(url, "killable-batching-caller")
    calls = [stream_request(nc, subject, {"s": s, "n": 100000}, stall_timeout=30) for s in range(4)]
    await asyncio.gather(*(c.__anext__() for c in calls))
    print("streaming", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_killed_batching_caller_stops_all_its_streams(nats_server, bus: BusContext,
                                                             stepper: Stepper) -> None:  # type: ignore[no-untyped-def]
    """The server answers a batch for a vanished inbox with "no responders" on the batch's reply
    subject, and every stream of that caller stops (no cancel subject, no stall timeout needed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CALLER, nats_server.url, stepper.subject], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        assert line.strip() == b"streaming"
        assert _mux(bus.nc).outbox.batches > 0
        proc.kill()
        await asyncio.wait_for(asyncio.gather(*(stepper.closed[s].wait() for s in range(4))), 5)
        assert not stepper.completed
    finally:
        proc.kill()
        proc.wait()
