"""One registry bucket kept current in process: one watch loop, one retry policy, many consumers.

A process that routes needs the live records more than once (the frontend's worker set, its KV
router's feed, a planner): :class:`BucketWatch` watches the bucket once, decodes each value once
into its record type, and hands puts and removals to every subscriber. Values that did not change
(a watch's replay of the current entries, an unchanged heartbeat) are not handed on again, and a
malformed value is logged and skipped (anyone on the bus can write the bucket).

A watch breaks when the server restarts or the bucket is recreated; it is then started again after
a :class:`bus.backoff.Backoff` delay, reading the bucket's current entries first so that what was
removed meanwhile is removed here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
from nats.js import JetStreamContext

from bus.backoff import Backoff
from bus.context import BusContext
from bus.registry import Registry
from bus.tasks import cancel_and_wait

from .contract import InstanceRecord, ModelCard

log = logging.getLogger(__name__)

T = TypeVar("T")
Put = Callable[[str, T], None]
Remove = Callable[[str], None]

# Re-watching is cheap; the cap keeps a bus that is down for minutes from being asked every 0.5 s.
RETRY = Backoff(initial=0.5, max=10.0)


class BucketWatch(Generic[T]):
    """The decoded entries of one bucket (``entries``: key → record), with subscribers."""

    def __init__(self, js: JetStreamContext, bucket: str, ttl: float, value_type: Any, *,
                 backoff: Backoff = RETRY) -> None:
        self.registry = Registry(js, bucket, ttl)  # also for writes beside the watch (a purge)
        self.backoff = backoff
        self.entries: dict[str, T] = {}
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(value_type)
        self._raw: dict[str, bytes] = {}
        self._subscribers: list[tuple[Put[T], Remove]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def bucket(self) -> str:
        return self.registry.bucket

    def subscribe(self, put: Put[T], remove: Remove) -> Callable[[], None]:
        """Hand the current entries to ``put`` now, then every change; returns the unsubscribe."""
        pair = (put, remove)
        self._subscribers.append(pair)
        for key, value in list(self.entries.items()):
            self._call(put, key, value)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(pair)

        return unsubscribe

    async def start(self) -> None:
        """Bind the bucket (creating it) and read its entries, so subscribers have them when this
        returns; then watch in the background."""
        if self._task is not None:
            return
        await self.registry.ensure()
        await self._sync()
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.bucket}")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    # --- internals ---------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        resync = False  # start() has just read the bucket
        while True:
            began = loop.time()
            try:
                if resync:
                    await self._sync()
                async for ev in self.registry.watch():
                    self._apply(ev.key, ev.value)
                why = "ended"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # reconnecting server, bucket recreated
                why = f"failed ({e})"
            if loop.time() - began >= self.backoff.reset_seconds:
                failures = 0  # it had been up a while: this is a new outage
            delay = self.backoff.delay(failures)
            failures += 1
            resync = True
            log.warning("watch of %s %s; watching again in %.1fs", self.bucket, why, delay)
            await asyncio.sleep(delay)

    async def _sync(self) -> None:
        current = await self.registry.items()
        for key in [k for k in self._raw if k not in current]:
            self._apply(key, None)
        for key, value in current.items():
            self._apply(key, value)

    def _apply(self, key: str, raw: bytes | None) -> None:
        if raw is None:
            if self._raw.pop(key, None) is None:
                return
            self.entries.pop(key, None)
            for _, remove in list(self._subscribers):
                self._call(remove, key)
            return
        if self._raw.get(key) == raw:
            return
        self._raw[key] = raw  # malformed too: logged once, not on every replay
        try:
            value = self._decoder.decode(raw)
        except msgspec.DecodeError as e:  # ValidationError included
            log.warning("ignoring malformed %s entry %s: %s", self.bucket, key, e)
            return
        self.entries[key] = value
        for put, _ in list(self._subscribers):
            self._call(put, key, value)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # one consumer's bug must not starve the others (or end the watch)
            log.exception("%s: a consumer failed on %s", self.bucket, args[0])


def watch_instances(bus: BusContext, ttl: float) -> BucketWatch[InstanceRecord]:
    """``<ns>-instances``: every live actor's record (``ttl`` applies if this creates the bucket)."""
    return BucketWatch(bus.js, bus.subjects.bucket_instances, ttl, InstanceRecord)


def watch_models(bus: BusContext, ttl: float) -> BucketWatch[ModelCard]:
    """``<ns>-models``: the model card of each pool."""
    return BucketWatch(bus.js, bus.subjects.bucket_models, ttl, ModelCard)
