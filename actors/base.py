"""Actor base class: endpoints on NATS, a micro service, a registry entry, a bounded drain.

Subclasses declare ``endpoints()`` whose handlers are plain async methods:
  unary:     ``async def h(self, req, headers) -> reply``          (reply: Struct, dict, ...)
  streaming: ``async def h(self, req, headers) -> AsyncIterator``  (an async generator of chunks)
The base does the transport: decoding (malformed input -> typed 400), encoding in the request's
Content-Type, ADR-32 error replies, stream protocol (bus.stream), cancellation, stats, lifecycle.

Lifecycle (a supervisors.child.Child):
  start = on_start -> subscribe endpoints + micro service (flushed: live on the server) ->
          ``ready_probe`` (e.g. an engine answers a request through its own subject) -> registry
          entry with heartbeat. A record in the registry therefore means "can serve now".
  stop  = deregister first (routers stop sending) -> keep serving for ``deregister_grace`` (what
          was routed before the removal reached the routers still lands) -> unsubscribe -> drain
          in-flight within ``drain_timeout`` (then cancel) -> on_stop;
  fail(exc) = crash: tear down the same way without draining; wait() then raises ``exc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
from nats.aio.msg import Msg

from actors.instances.contract import InstanceRecord
from bus.context import BusContext
from bus.micro import EndpointSpec, ErrorSent, ServiceHandle, add_service
from bus.registry import Registry
from bus.rpc import respond
from bus.stream_responder import StreamCancels, request_id, respond_stream
from bus.wire import decode_payload

log = logging.getLogger(__name__)


@dataclass
class Endpoint:
    name: str
    subject: str
    handler: Callable[..., Any]
    request_type: Any = None  # msgspec Struct (validated) or None (plain JSON/msgpack value)
    streaming: bool = False
    queue_group: str | None = "q"
    metadata: dict[str, str] | None = None
    bounded: bool = True  # counts against max_concurrency (control endpoints may opt out)
    # False: an empty payload is a 400 instead of ``{}`` — for verbs that change state, so a stray
    # ``nats req <subject> ''`` cannot act. Such an endpoint needs a Struct request type that
    # forbids unknown fields (see ``strict_struct``), so a misspelt field is refused too.
    allow_empty: bool = True

    def __post_init__(self) -> None:
        if not self.allow_empty and not strict_struct(self.request_type):
            raise TypeError(f"endpoint {self.name!r}: allow_empty=False needs a msgspec Struct request type "
                            f"with forbid_unknown_fields=True, not {self.request_type!r}")


def strict_struct(t: Any) -> bool:
    """A msgspec Struct type that refuses unknown fields."""
    return isinstance(t, type) and issubclass(t, msgspec.Struct) and t.__struct_config__.forbid_unknown_fields


class Actor:
    kind: ClassVar[str] = "actor"
    description: ClassVar[str] = "actor"
    version: ClassVar[str] = "0.1.0"
    registry_ttl: ClassVar[float] = 10.0
    # Seconds between leaving the registry and unsubscribing on a graceful stop (actors that are
    # routed to set it): watchers learn of the removal within milliseconds, so this only covers
    # requests already routed to us.
    deregister_grace: ClassVar[float] = 0.0

    def __init__(self, bus: BusContext, *, instance: str | None = None, role: str = "", model: str = "",
                 max_concurrency: int = 64, drain_timeout: float = 10.0, register: bool = True) -> None:
        self.bus = bus
        self.instance = instance or f"{self.kind}-{secrets.token_hex(4)}"
        self.name = self.instance  # supervisors.child.Child
        self.role = role
        self.model = model
        self.max_concurrency = max_concurrency
        self.drain_timeout = drain_timeout
        self.register_instance = register
        self.started_at = 0.0
        self.cancels = StreamCancels()
        self._sem = asyncio.Semaphore(max_concurrency)
        self._service: ServiceHandle | None = None
        self._registry: Registry | None = None
        self._done: asyncio.Future[None] | None = None
        self._teardown: asyncio.Task[None] | None = None
        self._stopping = False

    # --- to override -------------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        return []

    def cancel_subject(self) -> str:
        return self.bus.subjects.actor(self.kind, self.instance, "cancel")

    def record(self) -> InstanceRecord | dict[str, Any]:
        """Registry value in ``<ns>-instances`` under key ``instance``: an InstanceRecord, handed out
        as its JSON mapping so that a helper actor can add facts of its own (the worker it serves);
        an actor whose facts are all InstanceRecord fields returns the Struct itself."""
        rec = InstanceRecord(instance=self.instance, kind=self.kind, role=self.role, model=self.model,
                             host=self.bus.host, pid=os.getpid(), started_at=self.started_at)
        return msgspec.to_builtins(rec)

    def metadata(self) -> dict[str, str]:
        return {"namespace": self.bus.namespace, "host": self.bus.host, "role": self.role,
                "model": self.model, "instance": self.instance, "pid": str(os.getpid())}

    def statistics(self) -> dict[str, Any]:
        return {}

    async def on_start(self) -> None:
        pass

    async def on_stop(self) -> None:
        pass

    async def ready_probe(self) -> None:
        """Runs once the endpoints are live and before the registry entry is written; raise if the
        actor cannot serve yet (the start then fails and the supervisor retries it)."""

    # --- state ------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests of the bounded endpoints (those sharing ``max_concurrency``) running now."""
        return self._service.bounded_in_flight() if self._service is not None else 0

    @property
    def registry(self) -> Registry | None:
        return self._registry

    def _stats_data(self) -> dict[str, Any]:
        base = {"instance": self.instance, "kind": self.kind, "in_flight_total": self.in_flight,
                "max_concurrency": self.max_concurrency, "streams_cancelled": self.cancels.cancelled,
                "uptime_s": round(time.time() - self.started_at, 3) if self.started_at else 0.0}
        base.update(self.statistics())
        return base

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._stopping = False
        self.started_at = time.time()
        await self.on_start()
        specs = [self._spec(ep) for ep in self.endpoints()]
        specs.append(EndpointSpec(name="cancel", subject=self.cancel_subject(), handler=self.cancels.handle,
                                  queue_group=None, inline=True))
        try:
            self._service = await add_service(self.bus.nc, name=self.kind, version=self.version,
                                              description=self.description, metadata=self.metadata(),
                                              endpoints=specs, stats=self._stats_data)
            await self.ready_probe()
            if self.register_instance:
                self._registry = self.bus.registry(self.bus.subjects.bucket_instances, self.registry_ttl)
                await self._registry.ensure()
                await self._registry.register(self.instance, self.record())
        except BaseException:
            await self._shutdown(drain=0.0)
            raise
        log.info("%s %s started (%d endpoints)", self.kind, self.instance, len(specs))

    async def wait(self) -> None:
        assert self._done is not None, "not started"
        await asyncio.shield(self._done)

    async def stop(self, timeout: float | None = None) -> None:
        if self._stopping:
            if self._teardown is not None:
                await asyncio.shield(self._teardown)
            return
        drain = 0.0 if timeout is None else min(self.drain_timeout, timeout)
        await self._shutdown(drain)
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Crash: stop serving now (no drain); ``wait()`` raises ``exc`` once torn down."""
        if self._stopping:
            return
        log.error("%s %s failed: %r", self.kind, self.instance, exc)
        self._teardown = asyncio.ensure_future(self._crash(exc))

    async def _crash(self, exc: BaseException) -> None:
        try:
            await self._shutdown(drain=0.0)
        finally:
            if self._done is not None and not self._done.done():
                self._done.set_exception(exc)

    async def _shutdown(self, drain: float) -> None:
        self._stopping = True
        if self._registry is not None:  # first: routers stop picking us while we drain
            await self._registry.deregister(self.instance)
            await self._registry.close()
            if drain > 0 and self.deregister_grace > 0:
                await asyncio.sleep(min(self.deregister_grace, drain))
        svc = self._service
        if svc is not None:
            await svc.stop_accepting(keep=frozenset({"cancel"}))  # callers may still cancel while we drain
            cancelled = await svc.drain(drain)
            if cancelled:
                log.warning("%s %s: cancelled %d requests still running after %.1fs drain",
                            self.kind, self.instance, cancelled, drain)
            await svc.stop(0.0)
        with contextlib.suppress(Exception):
            await self.bus.nc.flush(timeout=2)
        try:
            await self.on_stop()
        except Exception:
            log.exception("%s %s: on_stop failed", self.kind, self.instance)
        log.info("%s %s stopped", self.kind, self.instance)

    # --- transport wrappers --------------------------------------------------------------------------
    def _spec(self, ep: Endpoint) -> EndpointSpec:
        handler = self._streaming(ep) if ep.streaming else self._unary(ep)
        return EndpointSpec(name=ep.name, subject=ep.subject, handler=handler, queue_group=ep.queue_group,
                            metadata=ep.metadata, concurrency=self._sem if ep.bounded else None)

    def _unary(self, ep: Endpoint) -> Callable[[Msg], Any]:
        async def handle(msg: Msg) -> None:
            headers = msg.headers or {}
            # BadRequest -> 400 reply
            req = decode_payload(msg.data, headers, ep.request_type, allow_empty=ep.allow_empty)
            reply = await ep.handler(req, headers)
            await respond(msg, reply if reply is not None else {})

        return handle

    def _streaming(self, ep: Endpoint) -> Callable[[Msg], Any]:
        async def handle(msg: Msg) -> None:
            headers = msg.headers or {}
            req = decode_payload(msg.data, headers, ep.request_type, allow_empty=ep.allow_empty)
            task = asyncio.current_task()
            assert task is not None
            self.cancels.track(request_id(msg), task)
            chunks = ep.handler(req, headers)
            if inspect.isawaitable(chunks):  # `async def` returning an iterator: validate, then stream
                chunks = await chunks
            err = await respond_stream(self.bus.nc, msg, chunks,
                                       cancel_subject=self.cancel_subject(), instance=self.instance)
            if err is not None:
                raise ErrorSent(err)

        return handle
