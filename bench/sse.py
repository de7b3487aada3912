"""The events of an OpenAI server-sent-event stream, as the benches read them."""

from __future__ import annotations

import json
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
