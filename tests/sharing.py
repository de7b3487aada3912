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
