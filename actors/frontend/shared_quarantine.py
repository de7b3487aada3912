"""Request-of-death fingerprints shared by every frontend, in the ``<ns>-quarantine`` bucket.

A frontend that quarantines a request (``actors.frontend.quarantine``) puts its fingerprint in a
JetStream KV bucket whose TTL is ``frontend.quarantine_ttl``; every frontend watches that bucket and
refuses what it holds. A frontend process that starts (or restarts) reads the entries still live, so
a request of death costs two worker deaths per deployment, not two per frontend process. The
bucket's expiry (a limit marker, seen by the watch) ends the refusal everywhere at once;
``nats kv ls <ns>-quarantine`` shows what is refused, and ``nats kv del`` lifts a refusal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from actors.instances.watch import BucketWatch
from bus.context import BusContext

from .quarantine import Quarantine

log = logging.getLogger(__name__)


class SharedQuarantine:
    def __init__(self, bus: BusContext, quarantine: Quarantine, instance: str) -> None:
        self.bus = bus
        self.quarantine = quarantine
        self.instance = instance
        self.watch: BucketWatch[dict[str, Any]] = BucketWatch(
            bus.js, bus.subjects.bucket_quarantine, quarantine.ttl, dict[str, Any])
        self._unsubscribe: Callable[[], None] | None = None
        self._puts: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        # created with the deployment's replicas (the watch alone would make a single replica)
        await self.bus.registry(self.watch.bucket, self.quarantine.ttl).ensure()
        self._unsubscribe = self.watch.subscribe(self._put, self._removed)
        await self.watch.start()
        self.quarantine.on_added = self._added

    async def stop(self) -> None:
        self.quarantine.on_added = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for task in list(self._puts):
            task.cancel()
        await self.watch.stop()

    def _put(self, fp: str, value: dict[str, Any]) -> None:
        if value.get("origin") != self.instance:
            log.warning("request fingerprint %s quarantined by frontend %s (request %s): refused here too",
                        fp, value.get("origin"), value.get("request_id"))
        self.quarantine.adopt(fp)

    def _removed(self, fp: str) -> None:
        self.quarantine.release(fp)

    def _added(self, fp: str, request_id: str, workers: Sequence[str]) -> None:
        task = asyncio.get_running_loop().create_task(self._publish(fp, request_id, list(workers)))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _publish(self, fp: str, request_id: str, workers: list[str]) -> None:
        try:
            await self.watch.registry.put(fp, {"origin": self.instance, "request_id": request_id,
                                               "workers": workers})
        except Exception as e:  # noqa: BLE001 - still refused here; the others may see it again
            log.warning("quarantine of %s not shared with the other frontends: %s", fp, e)
