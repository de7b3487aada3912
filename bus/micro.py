"""NATS micro services (ADR-32): ``$SRV.PING|INFO|STATS`` replies the NATS CLI accepts.

Why not ``nats.micro``: it awaits each handler inside the subscription callback, so an endpoint
serves one request at a time, and a handler that hands work to a task loses the error and timing
accounting. Here each request runs as its own task (optionally bounded by a semaphore, which
back-pressures through the subscription's pending queue), and stats are recorded when it finishes.
Handlers report errors by raising: ``ActorError`` becomes an ADR-32 error reply; ``ErrorSent``
means "already reported to the caller (e.g. as the final stream message), only count it".
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus.connection import flush_in_order
from bus.errors import ActorError
from bus.wire import bounded_text, error_headers

log = logging.getLogger(__name__)

PREFIX = "$SRV"
PING_TYPE = "io.nats.micro.v1.ping_response"
INFO_TYPE = "io.nats.micro.v1.info_response"
STATS_TYPE = "io.nats.micro.v1.stats_response"
NAME_RE = re.compile(r"^[A-Za-z0-9\-_]+$")
SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
    r"(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$")

Handler = Callable[[Msg], Awaitable[None]]


class ErrorSent(Exception):
    """Raised by a handler whose error already reached the caller; counted, not replied again."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class EndpointSpec:
    name: str
    subject: str
    handler: Handler
    queue_group: str | None = "q"  # None: every instance receives every message
    metadata: dict[str, str] | None = None
    concurrency: asyncio.Semaphore | None = None  # bound on concurrent handler tasks
    inline: bool = False  # run inside the subscription callback (tiny control handlers, in order)


@dataclass
class _Endpoint:
    spec: EndpointSpec
    sub: Subscription | None = None
    num_requests: int = 0
    num_errors: int = 0
    last_error: str = ""
    processing_time: int = 0  # ns
    in_flight: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ServiceHandle:
    def __init__(self, nc: Client, name: str, version: str, description: str, metadata: dict[str, str],
                 endpoints: list[EndpointSpec], stats: Callable[[], dict[str, Any]]) -> None:
        if not NAME_RE.match(name):
            raise ValueError(f"invalid service name {name!r}: letters, digits, '-' and '_' only")
        if not SEMVER_RE.match(version):
            raise ValueError(f"invalid service version {version!r}: must be semver")
        for ep in endpoints:
            if not NAME_RE.match(ep.name):
                raise ValueError(f"invalid endpoint name {ep.name!r}")
        self.nc = nc
        self.id = nc._nuid.next().decode()
        self.name = name
        self.version = version
        self.description = description
        self.metadata = {str(k): str(v) for k, v in metadata.items()}
        self._stats_cb = stats
        self._endpoints = [_Endpoint(spec) for spec in endpoints]
        self._control: list[Subscription] = []
        self.started = _now_rfc3339()
        self.accepting = False

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        for ep in self._endpoints:
            await self._subscribe(ep)
        for verb, handler in (("PING", self._ping), ("INFO", self._info), ("STATS", self._stats)):
            for subj in (f"{PREFIX}.{verb}", f"{PREFIX}.{verb}.{self.name}",
                         f"{PREFIX}.{verb}.{self.name}.{self.id}"):
                self._control.append(await self.nc.subscribe(subj, cb=handler))
        self.started = _now_rfc3339()
        self.accepting = True
        await flush_in_order(self.nc)  # subscriptions are live on the server when start() returns

    async def stop_accepting(self, drain_pending: bool = False, keep: frozenset[str] = frozenset()) -> None:
        """Unsubscribe the endpoints except ``keep`` (requests already delivered keep running)."""
        self.accepting = False
        for ep in self._endpoints:
            if ep.spec.name not in keep:
                await self._unsubscribe(ep, drain_pending)

    async def pause(self, names: Collection[str]) -> None:
        """Unsubscribe the named endpoints while the service stays up (e.g. a sleeping worker leaves
        its queue group, so the group delivers to the others); requests already delivered keep
        running. ``resume`` subscribes them again."""
        for ep in self._endpoints:
            if ep.spec.name in names:
                await self._unsubscribe(ep, drain=False)
        await self._sync()

    async def resume(self, names: Collection[str]) -> None:
        """Subscribe the named endpoints that ``pause`` took off again."""
        for ep in self._endpoints:
            if ep.spec.name in names and ep.sub is None:
                await self._subscribe(ep)
        await self._sync()

    async def _subscribe(self, ep: _Endpoint) -> None:
        ep.sub = await self.nc.subscribe(ep.spec.subject, queue=ep.spec.queue_group or "",
                                         cb=self._callback(ep))

    async def _unsubscribe(self, ep: _Endpoint, drain: bool) -> None:
        if ep.sub is None:
            return
        sub, ep.sub = ep.sub, None
        try:
            await (sub.drain() if drain else sub.unsubscribe())
        except Exception as e:  # connection closing: the server drops our interest anyway
            log.debug("unsubscribe %s: %s", ep.spec.subject, e)

    async def _sync(self) -> None:
        """Best effort: the (un)subscriptions have reached the server when this returns (a
        connection that is down gets them on reconnect anyway)."""
        try:
            await self.nc.flush(timeout=2)
        except Exception as e:
            log.debug("flush: %s", e)

    def bounded_in_flight(self) -> int:
        """Requests running now on the endpoints that have a concurrency bound."""
        return sum(ep.in_flight for ep in self._endpoints if ep.spec.concurrency is not None)

    def in_flight_tasks(self) -> set[asyncio.Task[None]]:
        return set().union(*(ep.tasks for ep in self._endpoints)) if self._endpoints else set()

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` for in-flight handlers, then cancel the rest; returns #cancelled."""
        tasks = self.in_flight_tasks()
        if not tasks:
            return 0
        _done, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        return len(pending)

    async def stop(self, timeout: float = 5.0) -> None:
        await self.stop_accepting()
        await self.drain(timeout)
        for sub in self._control:
            try:
                await sub.unsubscribe()
            except Exception as e:
                log.debug("unsubscribe control: %s", e)
        self._control.clear()

    # --- request handling -----------------------------------------------------------------------
    def _callback(self, ep: _Endpoint) -> Callable[[Msg], Awaitable[None]]:
        async def on_msg(msg: Msg) -> None:
            if ep.spec.inline:
                await self._run(ep, msg)
                return
            sem = ep.spec.concurrency
            if sem is not None:
                await sem.acquire()  # blocks this subscription's delivery: natural back-pressure
            task = asyncio.create_task(self._run(ep, msg))
            ep.tasks.add(task)

            def done(t: asyncio.Task[None]) -> None:
                ep.tasks.discard(t)
                if sem is not None:
                    sem.release()

            task.add_done_callback(done)

        return on_msg

    async def _run(self, ep: _Endpoint, msg: Msg) -> None:
        t0 = time.perf_counter_ns()
        ep.num_requests += 1
        ep.in_flight += 1
        try:
            await ep.spec.handler(msg)
        except ErrorSent as e:
            self._count_error(ep, e.error)
        except ActorError as e:
            self._count_error(ep, e)
            await self._reply_error(msg, e)
        except asyncio.CancelledError:  # caller's cancel or shutdown: not an endpoint error
            raise
        except Exception as e:
            log.exception("%s: endpoint %s failed", self.name, ep.spec.name)
            self._count_error(ep, e)
            await self._reply_error(msg, ActorError(f"internal error: {type(e).__name__}: {e}"))
        finally:
            ep.in_flight -= 1
            ep.processing_time += time.perf_counter_ns() - t0

    @staticmethod
    def _count_error(ep: _Endpoint, e: BaseException | str) -> None:
        ep.num_errors += 1
        if isinstance(e, ActorError):
            text = f"{e.code}:{e.message}"
        else:
            text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        ep.last_error = bounded_text(text)  # it may quote a request; $SRV.STATS must stay small

    async def _reply_error(self, msg: Msg, err: ActorError) -> None:
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, b"", headers=error_headers(err))
            except Exception as e:
                log.debug("error reply failed: %s", e)

    # --- $SRV -------------------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return {"type": PING_TYPE, "name": self.name, "id": self.id, "version": self.version,
                "metadata": self.metadata}

    def info(self) -> dict[str, Any]:
        eps = []
        for ep in self._endpoints:
            d: dict[str, Any] = {"name": ep.spec.name, "subject": ep.spec.subject,
                                 "metadata": dict(ep.spec.metadata or {})}
            if ep.spec.queue_group:
                d["queue_group"] = ep.spec.queue_group
            eps.append(d)
        return {"type": INFO_TYPE, "name": self.name, "id": self.id, "version": self.version,
                "description": self.description, "metadata": self.metadata, "endpoints": eps}

    def stats(self) -> dict[str, Any]:
        try:
            data = dict(self._stats_cb())
        except Exception as e:  # a broken stats callback must not break `nats micro stats`
            log.warning("%s: stats callback failed: %s", self.name, e)
            data = {"stats_error": str(e)}
        eps = []
        for ep in self._endpoints:
            d: dict[str, Any] = {
                "name": ep.spec.name, "subject": ep.spec.subject,
                "num_requests": ep.num_requests, "num_errors": ep.num_errors,
                "last_error": ep.last_error, "processing_time": ep.processing_time,
                "average_processing_time": ep.processing_time // ep.num_requests if ep.num_requests else 0,
                "data": {**data, "in_flight": ep.in_flight},
            }
            if ep.spec.queue_group:
                d["queue_group"] = ep.spec.queue_group
            eps.append(d)
        return {"type": STATS_TYPE, "name": self.name, "id": self.id, "version": self.version,
                "metadata": self.metadata, "started": self.started, "endpoints": eps}

    async def _reply_json(self, msg: Msg, obj: dict[str, Any]) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, json.dumps(obj, default=str).encode())

    async def _ping(self, msg: Msg) -> None:
        await self._reply_json(msg, self.ping())

    async def _info(self, msg: Msg) -> None:
        await self._reply_json(msg, self.info())

    async def _stats(self, msg: Msg) -> None:
        await self._reply_json(msg, self.stats())


async def add_service(nc: Client, *, name: str, version: str, description: str, metadata: dict[str, str],
                      endpoints: list[EndpointSpec], stats: Callable[[], dict[str, Any]]) -> ServiceHandle:
    """Subscribe the endpoints and the $SRV control subjects; returns once they are live."""
    svc = ServiceHandle(nc, name, version, description, metadata, endpoints, stats)
    await svc.start()
    return svc
