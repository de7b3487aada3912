"""Shared engines in a session: when one may stop (after the last test that uses it), and keeping
its tests together.

A session-scoped fixture would keep its engine (gigabytes, a process) alive through every later
test module; stopping it after its last user frees it as a module-scoped one did.
"""

from __future__ import annotations

import pytest


def last_user(items: list[pytest.Item], fixture: str) -> pytest.Item | None:
    """The session's last test that uses ``fixture``, itself or through another fixture."""
    users = [i for i in items if fixture in getattr(i, "fixturenames", ())]
    return users[-1] if users else None


def together(items: list[pytest.Item], fixture: str) -> None:
    """Move the tests that use ``fixture`` next to each other, at the place of the first of them
    (their order among themselves, and everyone else's, kept)."""
    users = [i for i in items if fixture in getattr(i, "fixturenames", ())]
    if not users:
        return
    at = items.index(users[0])
    rest = [i for i in items if fixture not in getattr(i, "fixturenames", ())]
    items[:] = rest[:at] + users + rest[at:]


def parallel_groups(items: list[pytest.Item]) -> None:
    """What runs where under ``make test``'s ``pytest -n N --dist loadgroup`` (pytest-xdist): each
    test module stays on one worker, so a module-scoped deployment is booted once, not on each
    worker; and every vLLM test (``pytest.mark.vllm``) runs on one worker, in collection order, as
    a serial run does. The engines they share (``last_user``, ``together``) are then started once
    and stopped after their last user, and the machine holds one test's engines at a time (an
    engine is ~2.5 GiB). Without xdist the marks change nothing."""
    for item in items:
        group = "vllm" if item.get_closest_marker("vllm") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
