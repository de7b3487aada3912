"""Worker status servers listen where the topology says, loopback unless opened explicitly."""

from __future__ import annotations

import socket

import pytest

from actors.worker.metrics import WorkerMetrics
from actors.worker.status_http import StatusServer, status_bind_host
from config.topology import FrontendConfig, PoolConfig
from tests.helpers import listening_hosts


@pytest.mark.parametrize(("http", "status_host", "expected"), [
    ("127.0.0.1:8000", None, "127.0.0.1"),       # every shipped topology
    ("10.1.2.3:8000", None, "10.1.2.3"),         # the frontend's interface
    ("0.0.0.0:8000", None, "127.0.0.1"),         # an open frontend does not open the workers
    ("[::]:8000", None, "127.0.0.1"),
    (":8000", None, "127.0.0.1"),
    ("[::1]:8000", None, "::1"),
    ("0.0.0.0:8000", "0.0.0.0", "0.0.0.0"),      # opening them takes the explicit key
    ("127.0.0.1:8000", "10.1.2.3", "10.1.2.3"),
])
def test_status_host_follows_the_frontend(http: str, status_host: str | None, expected: str) -> None:
    assert status_bind_host(PoolConfig(status_host=status_host), FrontendConfig(http=http)) == expected


def test_pool_on_another_host_keeps_loopback() -> None:
    """The frontend's address belongs to the frontend's machine; a worker elsewhere cannot bind it."""
    pool = PoolConfig(host="gpu-box")
    assert status_bind_host(pool, FrontendConfig(http="10.1.2.3:8000", host="front")) == "127.0.0.1"


async def ready() -> tuple[bool, dict[str, object]]:
    return True, {}


async def test_default_status_server_listens_on_loopback_only() -> None:
    host = status_bind_host(PoolConfig(), FrontendConfig())
    srv = StatusServer(0, ready, WorkerMetrics("i", "m").render, host=host)
    await srv.start()
    try:
        assert listening_hosts(srv.port) == {"127.0.0.1"}
    finally:
        await srv.stop()


def test_listening_hosts_sees_wildcard_and_loopback() -> None:
    """The /proc reader itself: a 0.0.0.0 listener is told apart from a loopback one."""
    with socket.socket() as any_if, socket.socket() as lo:
        any_if.bind(("0.0.0.0", 0))
        any_if.listen()
        lo.bind(("127.0.0.1", 0))
        lo.listen()
        assert listening_hosts(any_if.getsockname()[1]) == {"0.0.0.0"}
        assert listening_hosts(lo.getsockname()[1]) == {"127.0.0.1"}
