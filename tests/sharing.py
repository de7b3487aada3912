"""When a shared engine or deployment may stop: after the session's last test that uses it.

A session-scoped fixture would keep its engine (gigabytes, a process) alive through every later
test module; stopping it after its last user frees it as a module-scoped one did.
"""

from __future__ import annotations

import pytest


def last_user(items: list[pytest.Item], fixture: str) -> pytest.Item | None:
    """The session's last test that uses ``fixture``, itself or through another fixture."""
    users = [i for i in items if fixture in getattr(i, "fixturenames", ())]
    return users[-1] if users else None
