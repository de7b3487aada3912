"""Error hierarchy shared by every actor.

Actor logic raises and catches these; NATS exceptions are translated into them at the transport
boundary (``bus.rpc``), so code outside ``bus/`` never imports ``nats``.

Recoverable errors concern one request (the caller may retry elsewhere); fatal errors concern the
actor itself (its supervisor should restart it), mirroring vLLM's EngineGenerateError/EngineDeadError.
"""

from __future__ import annotations


class ActorError(Exception):
    """Root of every error an actor reports. ``code`` follows HTTP semantics (400, 404, 503, ...)."""

    code: int = 500
    kind: str = "internal_error"
    param: str | None = None  # the request field at fault, when one is (OpenAI error bodies name it)

    def __init__(self, message: str, code: int | None = None, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param

    def __str__(self) -> str:
        return self.message


class RecoverableError(ActorError):
    """A single request failed; the actor is fine."""


class FatalError(ActorError):
    """The actor (or its engine) is no longer usable and must be restarted."""


# --- request-level -------------------------------------------------------------------------------
class BadRequest(RecoverableError):
    code = 400
    kind = "invalid_request_error"


class Forbidden(RecoverableError):
    """The request is well formed but this deployment does not allow it (an allow-list refused it)."""

    code = 403
    kind = "permission_error"


class NotFound(RecoverableError):
    code = 404
    kind = "not_found_error"


class PayloadTooLarge(RecoverableError):
    code = 413
    kind = "invalid_request_error"


class ClientTimeout(RecoverableError):
    """An HTTP client did not send its request (headers or body) in time: 408. Not RequestTimeout,
    which is a reply over the bus that did not come (504)."""

    code = 408
    kind = "timeout"


class Conflict(RecoverableError):
    code = 409
    kind = "conflict_error"


class Overloaded(RecoverableError):
    """Admission refused (queue full, no capacity)."""

    code = 503
    kind = "service_unavailable"


# --- transport-level (raised by bus.rpc on the caller side) --------------------------------------
class TransportError(RecoverableError):
    code = 503
    kind = "service_unavailable"


class Unavailable(TransportError):
    """Nobody is subscribed to the subject (NATS 'no responders')."""


class RequestTimeout(TransportError):
    """No reply within the deadline."""

    code = 504
    kind = "timeout"


class StreamStalled(TransportError):
    """A stream produced neither data nor heartbeat within the stall timeout (worker gone)."""


class ResponderGone(StreamStalled):
    """A silent stream whose responder no longer exists: its process left the bus (SIGKILLed, or
    not reconnected yet after a bus restart), or it dropped the stream (it took the caller for gone)."""


class StreamGap(TransportError):
    """A stream skipped a sequence number (a chunk was lost)."""


class RemoteError(RecoverableError):
    """The responder answered with Nats-Service-Error / Nats-Service-Error-Code."""

    def __init__(self, message: str, code: int = 500, kind: str | None = None) -> None:
        super().__init__(message, code)
        if kind:
            self.kind = kind


# --- actor/engine-level ----------------------------------------------------------------------------
class EngineDead(FatalError):
    """The engine died (vLLM EngineDeadError or an injected fault); the supervisor restarts it."""

    code = 503
    kind = "engine_dead"


class Escalation(FatalError):
    """A supervisor gave up (restart intensity exceeded) and passes the failure to its parent."""


def error_from_code(message: str, code: int) -> ActorError:
    """Rebuild a typed error from a Nats-Service-Error-Code on the caller side."""
    table: dict[int, type[ActorError]] = {400: BadRequest, 403: Forbidden, 404: NotFound, 409: Conflict,
                                          413: PayloadTooLarge}
    cls = table.get(code)
    if cls is not None:
        return cls(message)
    if code == 503 and message.startswith("engine dead"):
        return EngineDead(message)
    if code == 503:
        return Overloaded(message)
    return RemoteError(message, code)
