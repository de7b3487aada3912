"""Registry on JetStream KV: entries with a TTL kept alive by heartbeats; expiry = death.

Buckets are created with a bucket TTL (stream max_age) *and* limit markers (nats-server >= 2.11):
when an entry ages out the server writes a marker (``Nats-Marker-Reason: MaxAge``), so watchers see
an expiry as a removal instead of silence. ``deregister`` purges the key with a per-message TTL on the
purge marker, so watchers see the removal at once and the marker itself does not pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue

from bus import codec
from bus.backoff import Backoff
from bus.subjects import JS_API_INFO
from bus.tasks import cancel_and_wait, cancels, honouring_cancel

log = logging.getLogger(__name__)

EventKind = Literal["added", "updated", "removed"]

# what a replicated bucket answers while its stream has no leader yet (or JetStream none)
_UNSETTLED = (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
              nats.errors.TimeoutError)
SETTLE_BOUND_S = 15.0  # how long a first put waits for a settling bucket
SETTLE_BACKOFF = Backoff(initial=0.2, max=2.0, multiplier=2.0, jitter=0.2)
JS_NO_SUITABLE_PEERS = 10005  # JetStream's err_code: fewer servers up than the stream's replicas
PLACEMENT_REPORT_S = 10.0  # how often a bucket waiting for its replicas' servers says so


@dataclass(frozen=True)
class RegistryEvent:
    kind: EventKind
    key: str
    value: bytes | None


def _to_bytes(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return codec.encode(value)  # JSON, so `nats kv get` shows it


class Registry:
    def __init__(self, js: JetStreamContext, bucket: str, ttl: float = 10.0, replicas: int = 1) -> None:
        self.js = js
        self.bucket = bucket
        self.ttl = ttl
        self.replicas = replicas  # JetStream replicas when this process creates the bucket
        self._kv: KeyValue | None = None
        self._values: dict[str, bytes] = {}
        self._refresh: dict[str, asyncio.Task[None]] = {}

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError(f"registry {self.bucket}: call ensure() first")
        return self._kv

    async def ensure(self) -> None:
        """Bind the bucket, creating it (TTL + limit markers) when missing."""
        if self._kv is not None:
            return
        try:
            self._kv = await self.js.key_value(self.bucket)
            await self._adopt_ttl()
            return
        except nats.js.errors.BucketNotFoundError:
            pass
        cfg = KeyValueConfig(bucket=self.bucket, ttl=self.ttl, history=1, replicas=self.replicas,
                             limit_marker_ttl=max(1.0, self.ttl), description="vllm-actors registry")
        reports = _WaitReports(PLACEMENT_REPORT_S)
        while True:
            try:
                self._kv = await self.js.create_key_value(cfg)
                log.info("created KV bucket %s (ttl %.1fs, %d replica%s)", self.bucket, self.ttl,
                         self.replicas, "" if self.replicas == 1 else "s")
                return
            except nats.js.errors.BadRequestError as e:
                if e.err_code != JS_NO_SUITABLE_PEERS:  # created concurrently by another process
                    self._kv = await self.js.key_value(self.bucket)
                    await self._adopt_ttl()
                    return
            # A cluster answers once a majority is up (wait_for_jetstream), but a bucket of N replicas
            # needs N servers routed and current: wait for them as that wait does, saying so, instead
            # of failing the actor's start (and being restarted until its supervisor gives up).
            if reports.due():
                log.warning("registry %s: waiting %.0fs for %d JetStream servers to place the bucket on "
                            "(no suitable peers yet)", self.bucket, reports.waited(), self.replicas)
            await asyncio.sleep(0.5)

    async def _adopt_ttl(self) -> None:
        """An existing bucket's TTL wins (the heartbeat must beat *its* expiry, not ours)."""
        try:
            max_age = (await self.kv.status()).stream_info.config.max_age
        except Exception as e:
            log.warning("registry %s: cannot read bucket TTL: %s", self.bucket, e)
            return
        if max_age and abs(max_age - self.ttl) > 1e-6:
            log.info("registry %s: bucket TTL is %.1fs (asked %.1fs); using it", self.bucket, max_age, self.ttl)
            self.ttl = max_age

    async def put(self, key: str, value: Any) -> int:
        return await self.kv.put(key, _to_bytes(value))

    async def get(self, key: str) -> bytes | None:
        return await read_live(self.js, self.kv, key, direct=True)

    async def keys(self) -> list[str]:
        return sorted(await self.items())

    async def items(self) -> dict[str, bytes]:
        return await live_entries(self.js, self.kv)

    async def register(self, key: str, value: Any, heartbeat: float | None = None) -> None:
        """Put now and keep re-putting every ``heartbeat`` (default ttl/3) until deregistered.

        Calling it again for the same key updates the value the heartbeat refreshes.
        """
        data = _to_bytes(value)
        self._values[key] = data
        await self._first_put(key, data)
        if key not in self._refresh:
            interval = heartbeat or self.ttl / 3
            self._refresh[key] = asyncio.create_task(self._keepalive(key, interval),
                                                     name=f"registry-refresh-{key}")

    async def _first_put(self, key: str, data: bytes) -> None:
        """Put, riding out a clustered bucket that is still settling: a replicated stream answers
        only once its own leader is elected, which follows JetStream's (a bucket just created, a
        server just restarted or lost). Bounded, so that a bus that stays unavailable still fails
        the registration (and the actor's start, which its supervisor retries)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_BOUND_S
        attempt = 0
        while True:
            try:
                await self.kv.put(key, data)
                return
            except _UNSETTLED as e:
                if loop.time() >= deadline:
                    raise
                if attempt == 0:
                    log.info("registry %s: %s not stored yet (%s); retrying for up to %gs",
                             self.bucket, key, type(e).__name__, SETTLE_BOUND_S)
                await asyncio.sleep(SETTLE_BACKOFF.delay(attempt))
                attempt += 1

    async def _keepalive(self, key: str, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            data = self._values.get(key)
            if data is None:
                return
            try:
                await self.kv.put(key, data)
            except Exception as e:  # disconnected: retry next beat; the TTL gives us slack
                log.warning("registry %s: refresh of %s failed: %s", self.bucket, key, e)

    async def deregister(self, key: str) -> None:
        self._values.pop(key, None)
        task = self._refresh.pop(key, None)
        if task is not None:
            await cancel_and_wait([task])
        try:
            await self.kv.purge(key, msg_ttl=max(1.0, self.ttl))
        except Exception as e:
            log.warning("registry %s: deregister of %s failed (%s); it expires in %.1fs",
                        self.bucket, key, e, self.ttl)

    async def close(self) -> None:
        """Stop heartbeats without deleting (entries then expire by TTL)."""
        await cancel_and_wait(self._refresh.values())
        self._refresh.clear()
        self._values.clear()

    async def watch(self, key_filter: str = ">") -> AsyncIterator[RegistryEvent]:
        """Current entries first (as ``added``), then changes. Unchanged heartbeats are not reported;
        a removal is, also of a key not seen as ``added`` here (consumers ignore unknown keys).

        Consume it from its own task: cancelling a pending ``__anext__`` (e.g. ``wait_for`` timing out)
        closes an async generator, so the watch would end.
        """
        asked = cancels()
        watcher = await self.kv.watch(key_filter)
        known: dict[str, bytes] = {}
        try:
            if cancels() > asked:
                # the setup's requests lost a cancel (bus.tasks): end now, or the watch would
                # outlive its consumer's stop
                raise asyncio.CancelledError
            async for entry in watcher:
                if entry is None:  # end of the initial snapshot
                    continue
                if entry.operation in (KV_DEL, KV_PURGE):
                    # reported even for a key this watch never saw: a reader that listed the bucket
                    # before this watch began (BucketWatch.start) may hold it, and a delete made in
                    # between arrives here only as the key's last (delete) marker
                    known.pop(entry.key, None)
                    yield RegistryEvent("removed", entry.key, None)
                    continue
                value = entry.value or b""
                prev = known.get(entry.key)
                known[entry.key] = value
                if prev is None:
                    yield RegistryEvent("added", entry.key, value)
                elif prev != value:
                    yield RegistryEvent("updated", entry.key, value)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


async def read_live(js: JetStreamContext, kv: KeyValue, key: str, *, direct: bool) -> bytes | None:
    """``key``'s live value, or None. The raw message, not ``KeyValue.get()``: that does not
    recognise server limit markers (``Nats-Marker-Reason``) and would return an expired entry as an
    empty value. ``direct``: any replica may answer (fast; a lagging one may be stale)."""
    try:
        msg = await js.get_msg(kv._stream, subject=f"{kv._pre}{key}", direct=direct and kv._direct)
    except nats.js.errors.NotFoundError:
        return None
    h = msg.headers or {}
    if h.get(KV_OP) in (KV_DEL, KV_PURGE) or KV_MARKER_REASON in h:
        return None
    return msg.data or b""


READ_CONCURRENCY = 64  # reads in flight while listing a bucket


async def live_entries(js: JetStreamContext, kv: KeyValue) -> dict[str, bytes]:
    """Every live entry of ``kv`` (what ``nats kv ls`` + ``get`` show), read from the stream's leader.

    Not ``KeyValue.keys()``: nats-py ends that listing at the first message that reports nothing
    pending, and under concurrent puts (every heartbeat is one) a message can report 0 while others
    are still on their way (nats.py PR #995). With two writers re-putting 20 keys on one server,
    26 and 40 of 300 listings came back short (9 of them empty); that is the likely cause of a
    three-host test reading an empty registry in CI. Here the leader's per-subject state names the
    keys in one answer, then each key's last message is read from the leader too (a direct get may
    reach a replica that has not caught up). A key removed between the two reads is left out.
    """
    info = await js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
    keys = sorted(s[len(kv._pre):] for s in (info.state.subjects or {}))
    gate = asyncio.Semaphore(READ_CONCURRENCY)

    async def one(key: str) -> bytes | None:
        async with gate:
            return await read_live(js, kv, key, direct=False)

    values = await asyncio.gather(*(one(k) for k in keys))
    return {k: v for k, v in zip(keys, values, strict=True) if v is not None}


class _WaitReports:
    """When a wait with no bound says it still waits: at once, then every ``every`` seconds."""

    def __init__(self, every: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._every = every
        self._last: float | None = None

    def waited(self) -> float:
        return self._loop.time() - self._started

    def due(self) -> bool:
        now = self._loop.time()
        if self._last is not None and now - self._last < self._every:
            return False
        self._last = now
        return True


async def wait_for_jetstream(nc: Client, on_wait: Callable[[str], None],
                             attempt_timeout: float = 2.0, report_every: float = 10.0) -> None:
    """Return once JetStream answers (``$JS.API.INFO``); until then call ``on_wait`` now and then.

    A clustered JetStream answers only once a majority of its servers have elected a meta leader,
    so the first host of a cluster to start waits here for its peers instead of failing every
    registry write (and being restarted until its supervisor gives up). No bound: a host whose
    peers never come says so (``on_wait``: the log and the supervisor's STATUS=) for as long as it
    waits, which is what an operator starting hosts one by one expects.
    """
    reports = _WaitReports(report_every)
    while True:
        try:
            reply = await honouring_cancel(nc.request(JS_API_INFO, b"", timeout=attempt_timeout))
            error = json.loads(reply.data).get("error")
            if not error:
                if reports.waited() > attempt_timeout:
                    log.info("bus: JetStream answers after %.1fs", reports.waited())
                return
            problem = f"{error.get('code')} {error.get('description')}"
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            problem = type(e).__name__
        except ValueError:
            problem = "JetStream's answer is not JSON"
        if reports.due():
            on_wait(f"waiting {reports.waited():.0f}s for JetStream (a cluster answers once a "
                    f"majority of its servers is up and routed): {problem}")
        await asyncio.sleep(0.5)
