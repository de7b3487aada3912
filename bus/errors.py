"""Error hierarchy shared by every actor.

Actor logic raises and catches these; NATS exceptions are translated into them at the transport
boundary (``bus.rpc``), so code outside ``bus/`` never imports ``nats``.

Recoverable errors concern one request (the caller may retry elsewhere); fatal errors concern the
actor itself (its supervisor should restart it), mirroring vLLM's EngineGenerateError/EngineDeadError.

An error crosses the bus as its text, code and ``kind`` (``bus.wire``). A class declared with
``wire=True`` is rebuilt from its (kind, code) on the caller's side; the layers above declare their
own (``actors.worker.contract.EngineDead``), so this module knows nothing of engines or supervisors.
"""

from __future__ import annotations

# (kind, code) -> the class a caller rebuilds: filled by ``wire=True`` subclasses as they are defined
_WIRE_CLASSES: dict[tuple[str, int], type[ActorError]] = {}


class ActorError(Exception):
    """Root of every error an actor reports. ``code`` follows HTTP semantics (400, 404, 503, ...)."""

    code: int = 500
    kind: str = "internal_error"
    param: str | None = None  # the request field at fault, when one is (OpenAI error bodies name it)

    def __init_subclass__(cls, *, code: int | None = None, kind: str | None = None, wire: bool = False,
                          **kwargs: object) -> None:
        """``class Busy(RecoverableError, code=503, kind="...", wire=True)``: the HTTP code and
        OpenAI error type of the class; ``wire``: rebuilt from (kind, code) by callers over the bus."""
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if kind is not None:
            cls.kind = kind
        if wire:
            key = (cls.kind, cls.code)
            if key in _WIRE_CLASSES:
                raise TypeError(f"{cls.__name__}: {key} is already {_WIRE_CLASSES[key].__name__} on the wire")
            _WIRE_CLASSES[key] = cls

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
class BadRequest(RecoverableError, code=400, kind="invalid_request_error", wire=True):
    """The request is malformed or asks for something the model cannot do."""


class Forbidden(RecoverableError, code=403, kind="permission_error", wire=True):
    """The request is well formed but this deployment does not allow it (an allow-list refused it)."""


class NotFound(RecoverableError, code=404, kind="not_found_error", wire=True):
    """No such model, adapter, instance or child."""


class PayloadTooLarge(RecoverableError, code=413, kind="invalid_request_error", wire=True):
    """A body or field over its cap."""


class ClientTimeout(RecoverableError, code=408, kind="timeout"):
    """An HTTP client did not send its request (headers or body) in time: 408. Not RequestTimeout,
    which is a reply over the bus that did not come (504)."""


class Conflict(RecoverableError, code=409, kind="conflict_error", wire=True):
    """The request contradicts the current state (a child or adapter that exists already)."""


class Overloaded(RecoverableError, code=503, kind="service_unavailable", wire=True):
    """Admission refused (queue full, no capacity)."""


# --- transport-level (raised by bus.rpc on the caller side) --------------------------------------
class TransportError(RecoverableError, code=503, kind="service_unavailable"):
    """The bus did not carry the request or its reply."""


class Unavailable(TransportError):
    """Nobody is subscribed to the subject (NATS 'no responders')."""


class RequestTimeout(TransportError, code=504, kind="timeout"):
    """No reply within the deadline."""


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


def error_from_wire(message: str, code: int, kind: str | None = None) -> ActorError:
    """Rebuild a typed error from a reply's Nats-Service-Error, -Code and Error-Kind headers: the
    class declared for that (kind, code), else the code's request-level class, else RemoteError."""
    cls = _WIRE_CLASSES.get((kind, code)) if kind else None
    if cls is None:
        table: dict[int, type[ActorError]] = {400: BadRequest, 403: Forbidden, 404: NotFound, 409: Conflict,
                                              413: PayloadTooLarge, 503: Overloaded}
        cls = table.get(code)
    if cls is not None:
        return cls(message)
    return RemoteError(message, code, kind)
