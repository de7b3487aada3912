"""The worker client: one generate stream to one worker instance, msgpack over ``bus.stream``.

Closing the returned StreamCall early (stop string, client gone, task cancelled) publishes a cancel
to the worker, which aborts the engine request.
"""

from __future__ import annotations

from typing import Any

from actors.worker.contract import GenerateChunk, GenerateRequest
from bus.stream import StreamCall, stream_request

from .discovery import Worker


class WorkerClient:
    def __init__(self, nc: Any, stall_timeout: float = 10.0) -> None:
        self.nc = nc
        self.stall_timeout = stall_timeout

    def stream(self, worker: Worker, req: GenerateRequest) -> StreamCall:
        return stream_request(self.nc, worker.subject, req, stall_timeout=self.stall_timeout,
                              msgpack=True, chunk_type=GenerateChunk)
