"""Transport of the KV router: KV events, load reports and the registry from NATS into a KvRouter.

:class:`KvRouterFeed` keeps one in-process :class:`KvRouter` current (each frontend runs its own;
they converge because they consume the same subjects and recover from the same publishers):

* ``Subjects.kv_events_all()`` → ``router.apply_event``. A :class:`Gap` (id jump, a worker first
  seen mid-stream, a new publisher epoch) starts a recovery *task* for that instance, so the event
  callback never waits on a request.
* Recovery asks the worker's KV publisher for a ``range`` (the missing ids), and for a ``dump``
  (its whole index) when the range is incomplete, the gap needs one, or a range makes no progress.
  While an instance recovers, its new events are buffered here and re-applied afterwards (the index
  drops duplicates by id), so nothing published during recovery is lost. Failed requests are
  retried until ``recovery_timeout``; a gap still open after that is retried every
  ``retry_interval`` (the worker keeps being routed with what the index already has).
* ``Subjects.load_all()`` (LoadReport) → ``router.reconcile``.
* The ``<ns>-instances`` registry, through the process's watch of it (``instances``: the frontend
  shares its own; without one the feed watches the bucket itself): a worker that appears is
  bootstrapped from a ``dump`` (a frontend started late knows nothing of the blocks cached before
  it); a worker whose entry is deleted or expires is dropped (``router.remove_worker``), and its
  later stray events are ignored until it registers again (a sleeping engine deregisters while its
  KV publisher lives on). ``known_workers()`` lists the live workers. With ``model`` set, only that
  model's workers are indexed (one KvRouter per model: models may use different block sizes). With
  ``watch_registry=False`` the feed runs on events alone: workers are learnt from their first event
  (a dump when that event is not id 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from actors.instances.contract import InstanceRecord
from actors.instances.watch import BucketWatch, watch_instances
from actors.kv.contract import (
    KvDumpReply,
    KvDumpRequest,
    KvRangeReply,
    KvRangeRequest,
    RouterKvEvent,
    decode_events,
)
from actors.router.kv_router import KvRouter
from actors.worker.contract import LoadReport
from bus import codec
from bus.connection import flush_in_order
from bus.context import BusContext
from bus.errors import ActorError
from bus.rpc import request
from bus.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Worker = tuple[str, int]


class KvRouterFeed:
    def __init__(self, bus: BusContext, router: KvRouter, *, recovery_timeout: float = 10.0,
                 request_timeout: float = 2.0, retry_interval: float = 0.5,
                 registry_ttl: float = 10.0, watch_registry: bool = True,
                 model: str | None = None, instances: BucketWatch[InstanceRecord] | None = None) -> None:
        if model is not None and not watch_registry:
            raise ValueError("a model filter needs the registry (it says which instance serves what)")
        self.bus = bus
        self.model = model
        self.router = router
        self.recovery_timeout = recovery_timeout
        self.request_timeout = request_timeout
        self.retry_interval = retry_interval
        # the registry's watch: shared (its owner starts and stops it) or, without one, our own
        self._owns_watch = watch_registry and instances is None
        if self._owns_watch:
            instances = watch_instances(bus, registry_ttl)
        self._instances = instances if watch_registry else None
        self._unwatch: Callable[[], None] | None = None
        # live worker records (of ``model``); written only by _on_record/_on_removed, which also drop
        # the caches below (known_workers/block_sizes run once per routed request)
        self.records: dict[str, InstanceRecord] = {}
        self._workers_cache: dict[str | None, list[Worker]] = {}
        self._sizes_cache: Mapping[Worker, int | None] | None = None
        self._buffers: dict[str, list[RouterKvEvent]] = {}  # instance -> events held during recovery
        self._recoveries: dict[str, asyncio.Task[None]] = {}
        self._bootstrapped: set[str] = set()
        # Instances whose registry entry went away: their stray events (e.g. a publisher outliving a
        # sleeping engine) must not bring them back into the index until they register again.
        self._departed: set[str] = set()
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self.counters = {"events": 0, "events_buffered": 0, "decode_errors": 0, "gaps": 0,
                         "ranges": 0, "dumps": 0, "recoveries": 0, "recovery_failures": 0,
                         "load_reports": 0, "workers_removed": 0,
                         "events_ignored": 0}
        self._decode_warned = float("-inf")  # monotonic time of the last undecodable-event warning

    # --- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.bus.subjects
        nc = self.bus.nc
        if self._instances is not None:
            # Current entries first, so a late frontend starts its dumps before any event arrives.
            if self._owns_watch:
                await self._instances.start()
            self._unwatch = self._instances.subscribe(self._on_record, self._on_removed)
        self._subs.append(await nc.subscribe(s.kv_events_all(), cb=self._on_event_msg))
        self._subs.append(await nc.subscribe(s.load_all(), cb=self._on_load_msg))
        await flush_in_order(nc)  # live before start() returns: no event published from now on is missed
        self._tasks.append(asyncio.create_task(self._retry_loop(), name="kv-feed-retry"))
        log.info("KV router feed started on %s (%d workers in the registry)", s.kv_events_all(),
                 len(self.records))

    async def stop(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._owns_watch and self._instances is not None:
            await self._instances.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        await cancel_and_wait(self._tasks + list(self._recoveries.values()))
        self._tasks = []
        self._recoveries.clear()
        self._buffers.clear()

    # --- queries -------------------------------------------------------------------------------------
    def known_workers(self, role: str | None = None) -> list[Worker]:
        """Live workers from the registry (every DP rank), optionally of one role; sorted."""
        cached = self._workers_cache.get(role)
        if cached is None:
            cached = self._workers_cache[role] = self._known_workers(role)
        return list(cached)

    def _known_workers(self, role: str | None) -> list[Worker]:
        out: list[Worker] = []
        for inst, rec in self.records.items():
            if (role is not None and rec.role != role) or rec.status != "ready":
                continue
            out.extend((inst, r) for r in range(max(1, rec.dp_size)))
        return sorted(out)

    def block_sizes(self) -> Mapping[Worker, int | None]:
        """Block sizes the workers registered (the router warns when one differs from its own).
        The same (read-only) mapping is returned until the registry changes."""
        if self._sizes_cache is None:
            out: dict[Worker, int | None] = {}
            for inst, rec in self.records.items():
                for r in range(max(1, rec.dp_size)):
                    out[(inst, r)] = rec.block_size
            self._sizes_cache = MappingProxyType(out)
        return self._sizes_cache

    @property
    def recovering(self) -> list[str]:
        return sorted(self._recoveries)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "recovering": self.recovering, "registry_workers": len(self.records)}

    async def wait_synced(self, timeout: float = 10.0) -> None:
        """Wait until no recovery runs and no gap is open (tests, readiness of a late frontend)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._recoveries or self._open_gaps():
            left = end - loop.time()
            if left <= 0:
                raise TimeoutError(f"KV feed not synced: recovering {self.recovering}, "
                                   f"gaps {self._open_gaps()}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))

    # --- events --------------------------------------------------------------------------------------
    async def _on_event_msg(self, msg: Msg) -> None:
        try:
            events = decode_events(msg.data, msg.headers)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as e:
            # anyone on the bus can publish here: count it, and log the first of each minute only
            self.counters["decode_errors"] += 1
            now = time.monotonic()
            if now - self._decode_warned >= 60.0:
                self._decode_warned = now
                log.warning("KV feed: undecodable event on %s (%d so far): %s", msg.subject,
                            self.counters["decode_errors"], str(e)[:200])
            return
        for ev in events:
            self.handle_event(ev)

    def handle_event(self, ev: RouterKvEvent) -> None:
        """Apply one event (synchronously: the hot path never awaits) or hold it during recovery."""
        self.counters["events"] += 1
        if ev.instance in self._departed or (self.model is not None and ev.instance not in self.records):
            self.counters["events_ignored"] += 1
            return
        buf = self._buffers.get(ev.instance)
        if buf is not None:
            buf.append(ev)
            self.counters["events_buffered"] += 1
            return
        if self.router.apply_event(ev) is not None:
            self.counters["gaps"] += 1
            self._recover(ev.instance)

    async def _on_load_msg(self, msg: Msg) -> None:
        try:
            report = codec.decode(msg.data, msg.headers, LoadReport)
        except ActorError as e:
            self.counters["decode_errors"] += 1
            log.warning("KV feed: bad load report on %s: %s", msg.subject, e)
            return
        self.counters["load_reports"] += 1
        self.router.reconcile(report)

    # --- recovery ------------------------------------------------------------------------------------
    def _open_gaps(self, instance: str | None = None) -> list:
        index = self.router.index
        gaps = index.pending_gaps() if hasattr(index, "pending_gaps") else []
        return [g for g in gaps if instance is None or g.worker[0] == instance]

    def _recover(self, instance: str, bootstrap: bool = False) -> None:
        if instance in self._recoveries:
            return  # the running task re-checks the gaps before it finishes
        self._buffers.setdefault(instance, [])
        task = asyncio.create_task(self._recovery(instance, bootstrap), name=f"kv-feed-recover-{instance}")
        self._recoveries[instance] = task
        task.add_done_callback(lambda t, i=instance: self._recovery_done(i, t))

    def _recovery_done(self, instance: str, task: asyncio.Task[None]) -> None:
        if self._recoveries.get(instance) is task:
            del self._recoveries[instance]
            self._flush(instance, final=True)
        self._changed.set()

    def _flush(self, instance: str, final: bool = False) -> None:
        """Re-apply the events held during recovery (synchronously, so none slip in between)."""
        buf = self._buffers.pop(instance, None) if final else self._buffers.get(instance)
        if not buf:
            return
        if not final:
            self._buffers[instance] = []
        for ev in sorted(buf, key=lambda e: (e.dp_rank, e.event_id)):
            self.router.apply_event(ev)  # new gaps stay open in the index; the loop picks them up

    async def _recovery(self, instance: str, bootstrap: bool) -> None:
        self.counters["recoveries"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.recovery_timeout
        need_dump = bootstrap
        last_starts: dict[Worker, int] = {}
        while True:
            try:
                gaps = self._open_gaps(instance)
                if need_dump or any(g.dump for g in gaps):
                    await self._dump(instance)
                    need_dump = False
                else:
                    for g in gaps:
                        if last_starts.get(g.worker) == g.start_event_id:
                            need_dump = True  # the same gap again: a range cannot fix it
                            break
                        last_starts[g.worker] = g.start_event_id
                        await self._range(instance, g.worker[1], g.start_event_id, g.end_event_id)
                    if need_dump:
                        continue
                self._flush(instance)
                if not self._open_gaps(instance):
                    return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # no responders, timeout, remote error: retry until the deadline
                if loop.time() + self.retry_interval >= deadline:
                    self.counters["recovery_failures"] += 1
                    log.warning("KV feed: recovery of %s failed (%s); keeping what the index has and "
                                "retrying every %.1fs", instance, e, self.retry_interval)
                    return
                log.debug("KV feed: recovery request for %s failed (%s); retrying", instance, e)
                await asyncio.sleep(self.retry_interval)
            if loop.time() >= deadline:
                self.counters["recovery_failures"] += 1
                log.warning("KV feed: recovery of %s did not converge within %.1fs", instance,
                            self.recovery_timeout)
                return

    async def _dump(self, instance: str) -> None:
        subject = self.bus.subjects.kv_index(instance, "dump")
        reply: KvDumpReply = await request(self.bus.nc, subject, KvDumpRequest(), msgpack=True,
                                           reply_type=KvDumpReply, timeout=self.request_timeout)
        self.counters["dumps"] += 1
        for snap in reply.snapshots:
            self.router.load_dump(instance, snap)
        log.info("KV feed: loaded dump of %s (%s)", instance,
                 ", ".join(f"rank {s.dp_rank}: {len(s.blocks)} blocks up to event {s.last_event_id}"
                           for s in reply.snapshots) or "no ranks")

    async def _range(self, instance: str, dp_rank: int, start: int, end: int | None) -> None:
        subject = self.bus.subjects.kv_index(instance, "range")
        req = KvRangeRequest(dp_rank=dp_rank, start_event_id=start, end_event_id=end)
        reply: KvRangeReply = await request(self.bus.nc, subject, req, msgpack=True,
                                            reply_type=KvRangeReply, timeout=self.request_timeout)
        self.counters["ranges"] += 1
        self.router.apply_range(reply)  # incomplete → the index asks for a dump
        log.info("KV feed: range %d..%s of %s/%d: %d events%s", start, end if end is not None else "",
                 instance, dp_rank, len(reply.events), "" if reply.complete else " (incomplete)")

    async def _retry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.retry_interval)
            for g in self._open_gaps():
                if g.worker[0] not in self._recoveries:
                    self._recover(g.worker[0])

    # --- registry ------------------------------------------------------------------------------------
    def _on_record(self, key: str, rec: InstanceRecord) -> None:
        if not rec.is_worker or (self.model is not None and rec.model != self.model):
            return
        self._workers_cache.clear()
        self._sizes_cache = None
        self.records[key] = rec
        self._departed.discard(key)
        if rec.role in ("decode", "encode", "embed") or key in self._bootstrapped:  # no KV publisher there
            return
        self._bootstrapped.add(key)
        self._recover(key, bootstrap=True)

    def _on_removed(self, key: str) -> None:
        self._workers_cache.clear()
        self._sizes_cache = None
        known = self.records.pop(key, None) is not None
        if known:
            self._departed.add(key)
        self._bootstrapped.discard(key)
        task = self._recoveries.pop(key, None)
        if task is not None:
            task.cancel()
        self._buffers.pop(key, None)
        if known:
            self.counters["workers_removed"] += 1
            log.info("KV feed: %s left the registry; dropping its blocks and load", key)
        self.router.remove_worker(key)
        self._changed.set()
