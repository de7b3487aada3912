"""The events of an OpenAI server-sent-event stream, as the benches read them."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


class SseStream:
    """Iterate ``events(response.content)``: each ``data:`` line's JSON, in order, until
    ``data: [DONE]``; ``done`` then says whether the stream ended with it (a stream cut short ends
    the iteration without it). A line that is not JSON raises ``json.JSONDecodeError``."""

    def __init__(self) -> None:
        self.done = False

    async def events(self, content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
        async for line in content:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                self.done = True
                return
            yield json.loads(data)


class TokenClock:
    """A streamed request's token times, from when it was sent: ``tick()`` at each chunk that carries
    a token; ``ttft`` (seconds, NaN before any) and ``itls`` (the gaps after the first)."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.ttft = float("nan")
        self.itls: list[float] = []
        self._last: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self.ttft = now - self.sent
        else:
            self.itls.append(now - self._last)
        self._last = now
