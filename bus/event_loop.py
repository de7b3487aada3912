"""The event loop every process of ours runs on: uvloop, the loop production runs (and that
tests/frontend/test_http_guard.py covers besides asyncio's).

uvloop is a core dependency; an environment that lacks it still runs, on plain asyncio, rather than
refusing to start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh loop, like ``asyncio.run``; return its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
