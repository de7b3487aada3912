"""EmbeddedNats as a supervised child: start/readiness, clean stop, unexpected exit raises."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port


async def test_start_stop_and_crash(tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"))
    await srv.start()
    try:
        nc = await connect(srv.url, "probe")
        js = nc.jetstream()
        assert (await js.account_info()).api.level >= 1  # JetStream with 2.11+ API (TTL markers)
        await nc.close()
        waiter = asyncio.create_task(srv.wait())
        await srv.stop(5.0)
        await asyncio.wait_for(waiter, 5)  # requested stop: wait() returns normally
        assert not srv.running

        await srv.start()  # restartable, same store dir
        waiter = asyncio.create_task(srv.wait())
        os.kill(srv.pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="unexpectedly"):
            await asyncio.wait_for(waiter, 5)
    finally:
        srv.kill_now()


async def test_port_in_use_fails_fast(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = EmbeddedNats(port=nats_server.port, store_dir=str(tmp_path / "js2"))
    with pytest.raises((RuntimeError, TimeoutError)):
        await srv.start(timeout=5)
    assert not srv.running


async def test_client_reconnects_after_server_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """More failed attempts than ``initial_attempts``: reconnection must go on (forever)."""
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"))
    await srv.start()
    try:
        nc = await connect(srv.url, "survivor", initial_attempts=1)
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg):  # type: ignore[no-untyped-def]
            got.put_nowait(msg.data)

        await nc.subscribe("restart.test", cb=on_msg)
        await srv.stop(5.0)
        await asyncio.sleep(2.5)  # several backoff rounds against a dead port
        await srv.start()
        for _ in range(100):  # wait for the reconnect (jittered backoff caps at ~7.5 s)
            if nc.is_connected:
                break
            await asyncio.sleep(0.1)
        assert nc.is_connected and nc.stats["reconnects"] >= 1
        await nc.publish("restart.test", b"after")  # the subscription was replayed on reconnect
        assert await asyncio.wait_for(got.get(), 5) == b"after"
        await nc.close()
    finally:
        srv.kill_now()


async def test_embedded_server_allows_large_payloads(nats_server) -> None:
    """KV index dumps are single messages: the embedded server takes 8 MiB, not NATS's 1 MiB."""
    import nats

    from bus.embedded import MAX_PAYLOAD

    nc = await nats.connect(nats_server.url)
    try:
        assert nc.max_payload == MAX_PAYLOAD
        sub = await nc.subscribe("big.dump")
        await nc.publish("big.dump", b"x" * (3 * 1024 * 1024))
        msg = await sub.next_msg(timeout=5)
        assert len(msg.data) == 3 * 1024 * 1024
    finally:
        await nc.close()


async def test_port_0_binds_a_port_the_kernel_picks_and_keeps_it_across_a_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = EmbeddedNats(port=0, store_dir=str(tmp_path / "js"))
    await srv.start()
    try:
        port = srv.port
        assert port > 0 and srv.url == f"nats://127.0.0.1:{port}"
        nc = await connect(srv.url, "probe")
        assert nc.is_connected
        await srv.stop()
        await srv.start()  # clients reconnect to the port they know
        assert srv.port == port
        await asyncio.wait_for(_until(lambda: nc.is_connected), 10)
        await nc.close()
    finally:
        await srv.stop()


async def _until(cond) -> None:  # type: ignore[no-untyped-def]
    while not cond():
        await asyncio.sleep(0.05)
