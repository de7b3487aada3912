"""Small helpers shared by test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(cond: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``cond`` until it is true; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)
