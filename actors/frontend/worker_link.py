"""The completion flow's view of the workers over the bus: the contract between the logic
(``completion_flow``, ``embeddings``, ``confirm``) and the bus adapter (``client.WorkerClient``).

Its own module so that the adapter implements it without importing the logic it serves, and so
that tests drive the logic with a fake link (tests/frontend/test_completion_flow.py).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Protocol

from actors.worker.contract import GenerateRequest

from .discovery import Worker
from .encode_step import EncodeLink


class WorkerStream(Protocol):
    """One generate call: its chunks, and the instance that answered (None until one did)."""

    instance: str | None

    def __aiter__(self) -> Any: ...

    async def aclose(self) -> None: ...


class Liveness(Enum):
    ALIVE = "alive"  # the worker's process answered on the bus
    DEAD = "dead"  # nobody is subscribed to its verbs, and the bus has been up long enough to say so
    UNKNOWN = "unknown"  # no answer in time (busy, or the bus is down): no verdict


class WorkerLink(EncodeLink, Protocol):
    """The flow's view of the bus (``actors.frontend.client.WorkerClient``)."""

    def stream(self, worker: Worker, req: GenerateRequest, headers: dict[str, str] | None = None) -> WorkerStream:
        """``headers``: added to the request's (the trace context, when the request is traced)."""
        ...

    async def connected(self) -> bool: ...

    async def liveness(self, worker: Worker) -> Liveness: ...
