"""The waker: a root's keeper of its cold pools when no planner runs (with a planner, the planner
actor keeps every pool itself; ``wake.PoolKeeper`` is the logic of both).

Micro service ``waker`` on ``<ns>.waker.<host>.status``: the pools it keeps, what runs for each,
and its last outcomes. It listens to ``<ns>.wake.demand`` (frontends holding requests for a cold
model) and ``<ns>.load.*`` (workers' idle seconds, for idle stop), and publishes what it did on
``<ns>.wake.outcome``. It acts only through the workers' ``wake_up`` verb and its root's ``spawn``
and ``stop``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import msgspec
from nats.aio.msg import Msg

from actors.base import Actor, Endpoint
from actors.instances.contract import InstanceRecord
from actors.instances.watch import BucketWatch, watch_instances
from actors.planner.contract import Action, Demand, WakeOutcome, WakerStatus
from actors.planner.scaler import Scaler
from actors.planner.wake import KeptPool, PoolKeeper
from actors.worker import contract as W
from bus import codec, rpc
from bus.context import BusContext
from bus.errors import Unavailable

log = logging.getLogger(__name__)


class BusWakeOps:
    """``wake.WakeOps`` over NATS: the registry watch, the roots' verbs, the workers' wake_up."""

    def __init__(self, bus: BusContext, instances: BucketWatch[InstanceRecord], scaler: Scaler) -> None:
        self.bus = bus
        self.instances = instances
        self.scaler = scaler

    def records(self) -> Iterable[InstanceRecord]:
        return list(self.instances.entries.values())

    async def children(self, host: str) -> list[dict[str, Any]]:
        return await self.scaler.children(host)

    async def wake_up(self, instance: str, timeout: float) -> None:
        reply = await rpc.request(self.bus.nc, self.bus.subjects.worker(instance, W.VERB_WAKE_UP), {},
                                  timeout=timeout, reply_type=W.StatusReply)
        if reply.status != "ok":
            raise Unavailable(f"{instance}: {reply.message}")

    async def spawn(self, host: str, pool: str, replica: int, engine: str) -> Action:
        return await self.scaler.spawn(host, pool, replica, engine)

    async def stop(self, host: str, pool: str, child: str) -> Action:
        return await self.scaler.stop(host, pool, child)

    async def publish(self, outcome: WakeOutcome) -> None:
        await self.bus.nc.publish(self.bus.subjects.wake_outcome(), codec.encode(outcome),
                                  headers=codec.headers_for(False))


class _Idle(msgspec.Struct):
    """The two fields of a ``LoadReport`` idle stop reads: the rest (its step samples above all,
    hundreds a second under load) is skipped by the decoder, not built, in the frontend's process."""

    instance: str
    idle_s: float | None = None


class KeeperFeed:
    """The subscriptions that feed a keeper (demand, and load reports when a kept pool has an
    idle stop); shared by the waker and the planner."""

    def __init__(self, bus: BusContext, keeper: PoolKeeper) -> None:
        self.bus = bus
        self.keeper = keeper
        self._subs: list[Any] = []

    async def start(self) -> None:
        s = self.bus.subjects
        self._subs = [await self.bus.nc.subscribe(s.wake_demand(), cb=self._on_demand)]
        if any(p.idle_stop is not None for p in self.keeper.pools.values()):
            self._subs.append(await self.bus.nc.subscribe(s.load_all(), cb=self._on_load))

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be gone already
                pass
        self._subs = []
        await self.keeper.close()

    async def _on_demand(self, msg: Msg) -> None:
        try:
            d = codec.decode(msg.data, msg.headers, Demand)
        except Exception as e:  # noqa: BLE001 - anyone on the bus can publish there
            log.debug("bad demand on %s: %s", msg.subject, e)
            return
        self.keeper.demand(d)

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = codec.decode(msg.data, msg.headers, _Idle)
        except Exception as e:  # noqa: BLE001
            log.debug("bad load report on %s: %s", msg.subject, e)
            return
        self.keeper.idle(report.instance, report.idle_s)


class WakerActor(Actor):
    kind: ClassVar[str] = "waker"
    description: ClassVar[str] = "waker: wakes or spawns a cold pool's replica on demand, removes idle ones"

    def __init__(self, bus: BusContext, *, pools: Mapping[str, KeptPool], model: str | None = None,
                 instance: str | None = None, **kw: Any) -> None:
        super().__init__(bus, instance=instance or f"waker-{bus.host}", role="waker", model=model or "", **kw)
        self.instances = watch_instances(bus, self.registry_ttl)
        self.keeper = PoolKeeper(pools.values(), BusWakeOps(bus, self.instances, Scaler(bus.nc, bus.subjects)),
                                 instance=self.instance, model=model)
        self.feed = KeeperFeed(bus, self.keeper)

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint("status", self.bus.subjects.waker(self.bus.host, "status"), self.status, None,
                         queue_group=None, bounded=False)]

    def statistics(self) -> dict[str, Any]:
        return {"pools": sorted(self.keeper.pools), "pending": dict(self.keeper.pending),
                "outcomes": len(self.keeper.recent)}

    async def on_start(self) -> None:
        await self.instances.start()
        await self.feed.start()
        log.info("waker %s keeps pools %s (idle stop: %s)", self.instance, ", ".join(self.keeper.pools) or "none",
                 ", ".join(f"{p.name} {p.idle_stop:g}s" for p in self.keeper.pools.values() if p.idle_stop)
                 or "off")

    async def on_stop(self) -> None:
        await self.feed.stop()
        await self.instances.stop()

    async def status(self, _req: Any, _h: Mapping[str, str]) -> WakerStatus:
        return WakerStatus(instance=self.instance,
                           pools={n: msgspec.to_builtins(p) for n, p in self.keeper.pools.items()},
                           pending=dict(self.keeper.pending), recent=list(self.keeper.recent))
