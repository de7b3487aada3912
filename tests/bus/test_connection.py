"""bus.connection's view of outages (settling after a reconnect, waiting for one, a closed connection)
and its flush that makes a subscription live."""

from __future__ import annotations

import asyncio
import os
import signal

from bus.connection import connect, flush_in_order, settling, until_closed, wait_connected
from bus.embedded import EmbeddedNats, free_port


async def test_settling_after_the_server_comes_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Right after a reconnect other processes may not be back yet: 'settling' says so for a window;
    a connection that never lost its server is not settling."""
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"))
    await srv.start()
    nc = await connect(srv.url, "settle-test")
    try:
        assert not settling(nc)
        assert srv.pid is not None
        os.kill(srv.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        assert settling(nc)  # cut off
        assert not await wait_connected(nc, 0.2)
        await srv.start()
        assert await wait_connected(nc, 20)
        assert settling(nc)  # back, but the others may still be reconnecting
        assert not settling(nc, window=0.0)
    finally:
        await nc.close()
        await srv.stop(5.0)


async def test_a_reconnect_is_settling_before_its_callback_runs(nats_server) -> None:  # type: ignore[no-untyped-def]
    """nats-py is connected again (and has counted the reconnect) before it replays the subscriptions,
    flushes and calls the reconnected callback; a caller in that gap must see 'settling' too."""
    nc = await connect(nats_server.url, "gap-test")
    try:
        assert not settling(nc)
        nc.stats["reconnects"] += 1  # where nats-py stands between CONNECTED and the callback
        assert settling(nc)
        await nc._reconnected_cb()  # the callback, run as nats-py runs it
        assert settling(nc)
        assert not settling(nc, window=0.0)
    finally:
        await nc.close()


async def test_until_closed_returns_when_the_connection_is_closed(nats_server) -> None:  # type: ignore[no-untyped-def]
    nc = await connect(nats_server.url, "closed-test")
    waiter = asyncio.ensure_future(until_closed(nc, poll=0.05))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await nc.close()
    await asyncio.wait_for(waiter, 2)


async def test_a_subscription_is_live_once_flush_in_order_returns(nats_server) -> None:  # type: ignore[no-untyped-def]
    """What another connection publishes right after ``flush_in_order`` reaches the new subscription,
    every time. (With a plain ``flush()`` 41-66 rounds of 1,000 missed it, nats-py's PING overtaking
    the queued SUB; with that rate, 300 rounds without a miss would be chance below 1 in 10^5.)"""
    a = await connect(nats_server.url, "flush-a")
    b = await connect(nats_server.url, "flush-b")
    try:
        for i in range(300):
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_msg(msg, got=got) -> None:  # type: ignore[no-untyped-def]
                got.put_nowait(msg.data)

            sub = await a.subscribe(f"flush.order.{i}", cb=on_msg)
            await flush_in_order(a)
            await b.publish(f"flush.order.{i}", b"x")
            await b.flush()
            assert await asyncio.wait_for(got.get(), 5) == b"x", f"round {i}"
            await sub.unsubscribe()
    finally:
        await a.close()
        await b.close()
