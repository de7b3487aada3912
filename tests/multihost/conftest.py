"""Fixtures for tests that run several "hosts" in network namespaces (tests/multihost/netns.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack

import pytest

from tests.multihost.netns import Hosts, available, sweep_leftovers

MakeHosts = Callable[..., Hosts]


@pytest.fixture(scope="session")
def netns_available() -> type[Hosts]:
    """Skips with the reason when this machine cannot make namespaces (not root, no `ip`, no veth);
    else removes what killed runs left behind, once per session, and hands over ``Hosts``."""
    reason = available()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    sweep_leftovers()
    return Hosts


@pytest.fixture
def make_hosts(netns_available: type[Hosts]) -> Iterator[MakeHosts]:
    """``make_hosts(("a", "b"))`` -> entered ``Hosts``, torn down (processes killed, namespaces
    deleted) after the test, whether it passed or not."""
    with ExitStack() as stack:
        def make(names: Sequence[str] = ("a", "b", "c")) -> Hosts:
            return stack.enter_context(netns_available(names))
        yield make
