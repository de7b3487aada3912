"""Echo actor: transport-only example (no logic worth separating from the endpoints)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import ClassVar

from actors.base import Actor, Endpoint
from actors.echo.contract import (
    VERB_CRASH,
    VERB_ECHO,
    VERB_STREAM,
    CrashReply,
    CrashRequest,
    EchoReply,
    EchoRequest,
    StreamChunk,
    StreamRequest,
)
from bus.errors import ActorError, BadRequest


class EchoCrash(RuntimeError):
    """The crash the ``crash`` endpoint injects (its supervisor should restart the actor)."""


class EchoActor(Actor):
    kind: ClassVar[str] = "echo"
    description: ClassVar[str] = "Echo example actor: unary echo, test stream, crash switch"
    version: ClassVar[str] = "0.1.0"
    max_stream_count: ClassVar[int] = 1_000_000

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.echoed = 0
        self.streams_started = 0
        self.streams_completed = 0
        self.streams_closed_early = 0
        self.chunks_sent = 0

    def endpoints(self) -> list[Endpoint]:
        s = self.bus.subjects
        return [
            Endpoint(VERB_ECHO, s.echo(VERB_ECHO), self.echo, EchoRequest),
            Endpoint(VERB_STREAM, s.echo(VERB_STREAM), self.stream, StreamRequest, streaming=True),
            Endpoint(VERB_CRASH, s.echo(VERB_CRASH), self.crash, CrashRequest, bounded=False, allow_empty=False),
        ]

    def statistics(self) -> dict[str, int]:
        return {"echoed": self.echoed, "streams_started": self.streams_started,
                "streams_completed": self.streams_completed,
                "streams_closed_early": self.streams_closed_early, "chunks_sent": self.chunks_sent}

    async def echo(self, req: EchoRequest, headers: Mapping[str, str]) -> EchoReply:
        if req.delay > 0:
            await asyncio.sleep(req.delay)
        self.echoed += 1
        return EchoReply(message=req.message, instance=self.instance)

    async def stream(self, req: StreamRequest, headers: Mapping[str, str]) -> AsyncIterator[StreamChunk]:
        if not 0 <= req.count <= self.max_stream_count:
            raise BadRequest(f"count must be within 0..{self.max_stream_count}")
        return self._chunks(req)

    async def _chunks(self, req: StreamRequest) -> AsyncIterator[StreamChunk]:
        self.streams_started += 1
        pad = "x" * req.size
        done = False
        try:
            for i in range(req.count):
                if req.fail_at is not None and i == req.fail_at:
                    raise ActorError(f"failing at chunk {i} as requested", code=422)
                if req.interval > 0:
                    await asyncio.sleep(req.interval)
                self.chunks_sent += 1
                yield StreamChunk(index=i, data=pad)
            done = True
        finally:
            if done:
                self.streams_completed += 1
            else:  # cancelled by the caller, caller gone, or error: the "engine request" is aborted
                self.streams_closed_early += 1

    async def crash(self, req: CrashRequest, headers: Mapping[str, str]) -> CrashReply:
        # Reply first, then fail on the next loop turn so the reply is already in the write buffer.
        asyncio.get_running_loop().call_soon(self.fail, EchoCrash(req.reason))
        return CrashReply(status="crashing", instance=self.instance)
