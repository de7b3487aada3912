"""Wire contract of the echo actor (subjects: ``Subjects.echo(verb)``)."""

from __future__ import annotations

import msgspec

VERB_ECHO = "echo"
VERB_STREAM = "stream"
VERB_CRASH = "crash"


class EchoRequest(msgspec.Struct, kw_only=True):
    message: str
    delay: float = 0.0  # seconds to hold the request (tests of drain and concurrency)


class EchoReply(msgspec.Struct, kw_only=True):
    message: str
    instance: str


class StreamRequest(msgspec.Struct, kw_only=True):
    count: int = 10
    interval: float = 0.0  # seconds between chunks
    size: int = 0  # bytes of padding per chunk (benchmarks)
    fail_at: int | None = None  # raise a BadRequest-coded error after this many chunks (error path)


class StreamChunk(msgspec.Struct, kw_only=True, array_like=True):
    index: int
    data: str = ""


class CrashRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Strict: the endpoint refuses an empty payload and unknown fields (send ``{}``)."""

    reason: str = "crash requested"


class CrashReply(msgspec.Struct, kw_only=True):
    status: str
    instance: str
