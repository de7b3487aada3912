"""Bus health on /metrics: computed from nats-py's own counts at scrape time (a real nats-server,
killed and started again for the reconnect)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from bus import metrics
from bus.connection import connect, wait_connected
from bus.embedded import EmbeddedNats, free_port


def value(name: str) -> float:
    v = metrics.REGISTRY.get_sample_value(name)
    assert v is not None, f"{name} is not exported"
    return v


async def test_connected_messages_and_reconnects(tmp_path: Path) -> None:
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"))
    await srv.start()
    before = {n: value(n) for n in ("vllm_actors_bus_connections", "vllm_actors_bus_connected",
                                    "vllm_actors_bus_sent_messages_total", "vllm_actors_bus_received_messages_total",
                                    "vllm_actors_bus_sent_bytes_total", "vllm_actors_bus_reconnects_total")}
    nc = await connect(srv.url, "metrics-test")
    try:
        assert value("vllm_actors_bus_connections") == before["vllm_actors_bus_connections"] + 1
        assert value("vllm_actors_bus_connected") == before["vllm_actors_bus_connected"] + 1
        got: list[bytes] = []

        async def on_msg(m) -> None:  # type: ignore[no-untyped-def]
            got.append(m.data)

        sub = await nc.subscribe("metrics.test", cb=on_msg)
        for _ in range(3):
            await nc.publish("metrics.test", b"12345")
        await nc.flush()
        while len(got) < 3:
            await asyncio.sleep(0.01)
        await sub.unsubscribe()
        assert value("vllm_actors_bus_sent_messages_total") >= before["vllm_actors_bus_sent_messages_total"] + 3
        assert value("vllm_actors_bus_received_messages_total") >= before["vllm_actors_bus_received_messages_total"] + 3
        assert value("vllm_actors_bus_sent_bytes_total") >= before["vllm_actors_bus_sent_bytes_total"] + 15
        assert srv.pid is not None
        os.kill(srv.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        assert value("vllm_actors_bus_connected") == before["vllm_actors_bus_connected"]  # ours is out
        await srv.start()
        assert await wait_connected(nc, 20)
        assert value("vllm_actors_bus_connected") == before["vllm_actors_bus_connected"] + 1
        assert value("vllm_actors_bus_reconnects_total") >= before["vllm_actors_bus_reconnects_total"] + 1
    finally:
        await nc.close()
        await srv.stop(5.0)
    assert value("vllm_actors_bus_connections") == before["vllm_actors_bus_connections"]  # closed: left out
