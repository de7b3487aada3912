"""Shared fixtures: one real nats-server per test session, a fresh namespace per test."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats, free_port
from tests import watchdog
from tests.agg_reference import AggReference
from tests.sharing import last_user, parallel_scope, together, vllm_files


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A hung test dumps its asyncio tasks to stderr before pytest-timeout kills it (tests/watchdog.py)."""
    timer = watchdog.arm(item.nodeid)
    try:
        yield
    finally:
        timer.cancel()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of the shared vLLM stack run one after another, from where the first of them was
    collected: its objects live on the session loop, which runs only while a test on it runs, so
    between two of its tests the worker's registry entry (10 s TTL) could lapse."""
    together(items, "shared_vllm_stack")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: work units of ``tests.sharing.parallel_scope`` (a test file, or every
    file with a vLLM test together). Not xdist's own loadgroup: it puts its ``xdist_group`` in the
    node id by a field pytest 9.2 no longer reads, so every test became a unit of its own (module
    fixtures booted on both workers, two vLLM tests at once)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    vllm = vllm_files(config.rootpath)

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return parallel_scope(nodeid, vllm)

    return ByScope(config, log)


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


@pytest.fixture(scope="session")
def agg_reference(tmp_path_factory: pytest.TempPathFactory) -> AggReference:
    """agg.toml's greedy answer for the disaggregated vLLM tests, recorded by the session's first
    agg.toml deployment instead of one deployment booted per module (tests/agg_reference.py)."""
    return AggReference(tmp_path_factory)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def shared_vllm_stack(nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    """tests/frontend/vllm_stack.py's SharedStack (vLLM is imported only when a test asks for it)."""
    from tests.frontend.vllm_stack import SharedStack

    shared = SharedStack(nats_server.url)
    try:
        yield shared
    finally:
        await shared.close()


@pytest_asyncio.fixture(loop_scope="session")
async def vllm_frontend(shared_vllm_stack: Any, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """One vLLM engine actor behind a kv-routed frontend, shared by the frontend's plain vLLM test
    modules (their tests run on the session loop: ``pytest.mark.asyncio(loop_scope="session")``).
    A test leaves it as it found it; it stops after the session's last test that uses it."""
    yield await shared_vllm_stack.get()
    if request.node is last_user(request.session.items, "shared_vllm_stack"):
        await shared_vllm_stack.close()
