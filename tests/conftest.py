"""Shared fixtures: one real nats-server per test session, a fresh namespace per test."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats, free_port
from tests import watchdog


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A hung test dumps its asyncio tasks to stderr before pytest-timeout kills it (tests/watchdog.py)."""
    timer = watchdog.arm(item.nodeid)
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A nats-server (JetStream on) on a free port; sync so it outlives every test's event loop."""
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path_factory.mktemp("nats-js")))
    srv.start_sync()
    try:
        yield srv
    finally:
        srv.stop_sync()


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[BusContext]:
    """A BusContext on a random namespace, so tests never see each other's subjects or buckets."""
    ns = "t" + secrets.token_hex(4)
    ctx = await open_context(nats_server.url, namespace=ns, host="testhost", name=f"test-{ns}")
    try:
        yield ctx
    finally:
        await ctx.close()
