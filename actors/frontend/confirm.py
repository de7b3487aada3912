"""Confirms registry records against the bus: a worker is routed to only once it has answered.

A JetStream bucket outlives the processes that wrote it: a deployment SIGKILLed and started again
within the registry TTL, or an external NATS whose buckets outlive deployments, shows records of
instances that no longer exist ("ghosts"). Each new record (instance + incarnation) is therefore
probed with a request to its instance's ``stats`` verb: an answer confirms it
(``WorkerSet.confirm``); "no responders" (NATS answers at once when nobody subscribes) marks it a
ghost that is never routed to, probed again while its record lasts, and purged from the bucket after
``purge_after`` failed probes so other watchers (and ``nats kv ls``) stop seeing it.

Confirmed instances are asked again every ``recheck`` seconds: a worker SIGKILLed without
deregistering keeps its record until the bucket's TTL (10 s), and for that long it would still be
routed to and counted ready. One that stops answering is taken out at once and probed as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import KW_ONLY, dataclass, field

from actors.instances.contract import InstanceRecord
from bus.context import BusContext
from bus.registry import Registry
from bus.tasks import cancel_and_wait

from .client import ask
from .discovery import WorkerSet
from .worker_link import Liveness

log = logging.getLogger(__name__)


@dataclass(eq=False)
class InstanceConfirmer:
    bus: BusContext
    workers: WorkerSet
    registry: Registry
    _: KW_ONLY
    timeout: float = 2.0  # seconds a probe waits for the answer
    retry: float = 1.0  # seconds between probes of an unconfirmed record
    purge_after: int = 3  # failed probes before the record is purged from the bucket
    recheck: float = 2.0  # seconds between probes of confirmed instances
    _probing: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _rechecker: asyncio.Task[None] | None = field(default=None, init=False)
    _answered: set[str] = field(default_factory=set, init=False)  # keys whose first probe has ended

    def put(self, key: str, value: InstanceRecord) -> None:
        """A ``BucketWatch`` put of ``<ns>-instances``: apply it, probe a new incarnation."""
        if self.workers.put_instance(key, value):
            self._probe(key)
        if self._rechecker is None:
            self._rechecker = asyncio.create_task(self._recheck_loop(), name="confirm-recheck")

    def _probe(self, key: str) -> None:
        if key not in self._probing:
            self._probing[key] = asyncio.create_task(self._confirm(key), name=f"confirm-{key}")

    def delete(self, key: str) -> None:
        self._answered.discard(key)
        self.workers.delete_instance(key)
        task = self._probing.pop(key, None)
        if task is not None:
            task.cancel()

    async def settled(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the first probe of every unconfirmed record seen so far
        has ended: it confirmed its record, found it gone, or timed out. True when none is pending."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if not any(self.workers.needs_confirmation(key) and key not in self._answered for key in self._probing):
                return True
            await asyncio.sleep(0.02)
        return False

    async def close(self) -> None:
        tasks = list(self._probing.values()) + ([self._rechecker] if self._rechecker else [])
        self._rechecker = None
        self._probing.clear()
        await cancel_and_wait(tasks)

    async def _confirm(self, key: str) -> None:
        misses = 0
        try:
            while self.workers.needs_confirmation(key):
                rec = self.workers.record(key)
                if rec is None:
                    return
                answered = await ask(self.bus, rec.instance, self.timeout)
                self._answered.add(key)
                if answered is Liveness.ALIVE:
                    self.workers.confirm(key, rec.started_at)
                    log.debug("instance %s confirmed on the bus", rec.instance)
                    continue  # done, unless a newer incarnation arrived meanwhile: probe that one
                if answered is Liveness.DEAD:
                    misses += 1
                    log.info("instance %s in the registry does not answer on the bus (%d/%d): not routed",
                             rec.instance, misses, self.purge_after)
                    if misses >= self.purge_after and self.workers.record(key) is rec:
                        await self._purge(key, rec.instance)
                        return
                await asyncio.sleep(self.retry)
        finally:
            if self._probing.get(key) is asyncio.current_task():
                del self._probing[key]

    async def _recheck_loop(self) -> None:
        while True:
            await asyncio.sleep(self.recheck)
            await asyncio.gather(*(self._recheck(k) for k in self.workers.confirmed_keys()))

    async def _recheck(self, key: str) -> None:
        rec = self.workers.record(key)
        if rec is None:
            return
        if await ask(self.bus, rec.instance, self.timeout) is Liveness.DEAD and self.workers.record(key) is rec:
            log.warning("instance %s stopped answering on the bus; not routed until it answers again",
                        rec.instance)
            self.workers.unconfirm(key)
            self._probe(key)

    async def _purge(self, key: str, instance: str) -> None:
        log.warning("purging registry record of %s: it never answered on the bus (a dead run's record)",
                    instance)
        self.workers.delete_instance(key)
        with contextlib.suppress(Exception):
            await self.registry.kv.purge(key)
