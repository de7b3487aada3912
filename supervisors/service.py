"""A Supervisor as a NATS micro service: ``children``, ``restart``, ``spawn``, ``stop``, ``escalate``.

JSON in, JSON out, no headers needed, so an operator can drive it with plain ``nats req``::

    nats req dynamo.supervisor.local.children ''
    nats req dynamo.supervisor.local.restart '{"id": "worker-0"}'
    nats req dynamo.supervisor.local.spawn '{"pool": "agg"}'

``spawn`` names a pool of the topology (and optionally a replica index), never a command: only a
root supervisor given a ``spawner`` (``deploy.pools.PoolSpawner``) adds children, and only
the ones its topology describes. Logic stays in ``Supervisor``; this module decodes, calls, replies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import msgspec
from nats.aio.msg import Msg

from bus import codec
from bus.context import BusContext
from bus.errors import ActorError, BadRequest, NotFound
from bus.micro import EndpointSpec, ServiceHandle, add_service
from bus.rpc import respond
from supervisors.child import ChildSpec
from supervisors.slot import describe
from supervisors.supervisor import Supervisor

log = logging.getLogger(__name__)

VERBS = ("children", "restart", "spawn", "stop", "escalate")


class _Req(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ChildRef(_Req):
    id: str
    wait: bool = True  # reply once the child is up again; False: reply at once ("accepted")


class StopRequest(_Req):
    id: str
    remove: bool = False


class EscalateRequest(_Req):
    reason: str
    child: str | None = None


class SpawnRequest(_Req):
    """Add a replica of a pool this supervisor runs; ``replica`` None = the lowest free index."""

    pool: str
    replica: int | None = None
    wait: bool = True  # reply once the worker is ready; False: reply at once ("accepted")


# (pool, replica or None, the supervisor's child ids) -> the new child's spec, or a typed error
Spawner = Callable[[str, int | None, Collection[str]], ChildSpec]


class SupervisorService:
    """Serves one Supervisor on ``Subjects.supervisor(host, verb)`` (or ``supervisor_node`` when
    ``node`` is given, for a supervisor nested under the host's root)."""

    def __init__(self, ctx: BusContext, supervisor: Supervisor, *, node: str | None = None,
                 spawner: Spawner | None = None, version: str = "0.1.0",
                 hosts_service: Collection[str] = ()) -> None:
        """``spawner``: builds the child a ``spawn`` asks for from the topology; None: this
        supervisor's children are fixed and ``spawn`` is refused. ``hosts_service``: children that
        run this service and its bus connection (the root's ``inproc``): a restart of one is
        answered at once ("accepted"), since no reply could follow it."""
        self.ctx = ctx
        self.hosts_service = frozenset(hosts_service)
        self.sup = supervisor
        self.node = node
        self.spawner = spawner
        self.version = version
        self.handle: ServiceHandle | None = None
        self._background: set[asyncio.Task[Any]] = set()

    def subject(self, verb: str) -> str:
        s = self.ctx.subjects
        if self.node is None:
            return s.supervisor(self.ctx.host, verb)
        return s.supervisor_node(self.ctx.host, self.node, verb)

    async def start(self) -> None:
        handlers: dict[str, Callable[[Msg], Awaitable[None]]] = {
            "children": self._children, "restart": self._restart, "spawn": self._spawn,
            "stop": self._stop, "escalate": self._escalate}
        endpoints = [EndpointSpec(name=v, subject=self.subject(v), handler=handlers[v]) for v in VERBS]
        meta = {"host": self.ctx.host, "namespace": self.ctx.namespace, "supervisor": self.sup.name,
                "strategy": self.sup.policy.strategy, **({"node": self.node} if self.node else {})}
        self.handle = await add_service(
            self.ctx.nc, name="supervisor", version=self.version,
            description=f"supervisor {self.sup.name} on {self.ctx.host}", metadata=meta,
            endpoints=endpoints, stats=self._stats)
        log.info("supervisor %s serving on %s", self.sup.name, self.subject("*"))

    async def stop(self) -> None:
        if self.handle is not None:
            await self.handle.stop(timeout=2.0)
            self.handle = None
        for t in list(self._background):
            t.cancel()

    def _stats(self) -> dict[str, Any]:
        kids = self.sup.children()
        return {"children": len(kids), "running": sum(c["state"] == "running" for c in kids),
                "restarts": sum(c["restarts"] for c in kids)}

    def _view(self) -> dict[str, Any]:
        return {"supervisor": self.sup.name, "host": self.ctx.host, "strategy": self.sup.policy.strategy,
                "running": self.sup.running, "children": self.sup.children()}

    def _child_view(self, child_id: str) -> dict[str, Any] | None:
        try:
            return self.sup.child(child_id)
        except NotFound:  # temporary or removed
            return None

    async def _run(self, coro: Awaitable[None], wait: bool, what: str) -> None:
        """Await ``coro`` (errors become replies) or run it in the background (errors logged)."""
        if wait:
            try:
                await coro
            except ActorError:
                raise
            except Exception as e:  # a child's own start error: report it, not as an internal bug
                raise ActorError(f"{what} failed: {describe(e)}") from e
            return

        async def bg() -> None:
            try:
                await coro
            except Exception as e:
                log.warning("supervisor %s: %s failed: %s", self.sup.name, what, describe(e))
        task = asyncio.create_task(bg())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- endpoints ---------------------------------------------------------------------------------
    async def _children(self, msg: Msg) -> None:
        await respond(msg, self._view())

    async def _restart(self, msg: Msg) -> None:
        req = codec.decode(msg.data, msg.headers, type=ChildRef)
        self.sup.child(req.id)  # NotFound now, even when not waiting
        if not req.wait or req.id in self.hosts_service:
            # answer (and flush) before the restart begins: the child may be the one that runs this
            # service and its bus connection (the root's "inproc"), and would take the reply with it
            await respond(msg, {"status": "accepted", "child": self._child_view(req.id)})
            await self.ctx.nc.flush(timeout=2)
            await self._run(self.sup.restart_child(req.id), False, f"restart of {req.id}")
            return
        await self._run(self.sup.restart_child(req.id), True, f"restart of {req.id}")
        await respond(msg, {"status": "ok", "child": self._child_view(req.id)})

    async def _spawn(self, msg: Msg) -> None:
        req = codec.decode(msg.data, msg.headers, type=SpawnRequest)
        if self.spawner is None:
            raise BadRequest(f"spawn: supervisor {self.sup.name} has a fixed set of children; a pool "
                             f"replica is added by its host's root supervisor "
                             f"({self.ctx.subjects.supervisor(self.ctx.host, 'spawn')})")
        spec = self.spawner(req.pool, req.replica, [c["id"] for c in self.sup.children()])
        log.info("supervisor %s: spawn of %s (pool %s) requested over the bus", self.sup.name, spec.id, req.pool)
        await self._run(self.sup.spawn(spec), req.wait, f"spawn of {spec.id}")
        await respond(msg, {"status": "ok" if req.wait else "accepted",
                            "child": self._child_view(spec.id)})

    async def _stop(self, msg: Msg) -> None:
        req = codec.decode(msg.data, msg.headers, type=StopRequest)
        await self.sup.stop_child(req.id, remove=req.remove)
        await respond(msg, {"status": "ok", "child": self._child_view(req.id)})

    async def _escalate(self, msg: Msg) -> None:
        req = codec.decode(msg.data, msg.headers, type=EscalateRequest)
        await self.sup.escalate(req.reason, child=req.child)
        await respond(msg, {"status": "accepted"})


async def serve_supervisor(ctx: BusContext, supervisor: Supervisor, **kw: Any) -> SupervisorService:
    """Start serving ``supervisor``; call ``stop()`` on the result before stopping the supervisor."""
    svc = SupervisorService(ctx, supervisor, **kw)
    await svc.start()
    return svc
