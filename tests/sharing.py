"""Shared engines in a session: when one may stop (after the last test that uses it), and keeping
its tests together.

A session-scoped fixture would keep its engine (gigabytes, a process) alive through every later
test module; stopping it after its last user frees it as a module-scoped one did.
"""

from __future__ import annotations

from pathlib import Path

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


def vllm_files(root: Path) -> frozenset[str]:
    """The test files (relative to ``root``) that mark a test ``vllm``: read from their text, since
    pytest-xdist's controller schedules by node id and collects nothing itself."""
    return frozenset(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                     if "mark.vllm" in p.read_text())


def parallel_scope(nodeid: str, vllm: frozenset[str]) -> str:
    """What runs where under ``make test``'s ``pytest -n N --dist loadgroup`` (tests/conftest.py's
    scheduler): each test file on one worker, so a module-scoped deployment is booted once, not on
    each worker; and every file with a vLLM test on one worker, in collection order, as a serial
    run does: the engines they share (``last_user``, ``together``) are then started once and
    stopped after their last user, and the machine holds one test's engines at a time (an engine
    is ~2.5 GiB)."""
    path = nodeid.split("::", 1)[0]
    return "vllm" if path in vllm else path
