"""The bus side of one routing view across frontend processes (``actors.router.bookings``).

Each turn of the loop, what the router booked, saw prefill and finished goes out as one
``BookingBatch`` on ``<ns>.router.bookings.<instance>``; every other frontend's batches are applied
as remote bookings. Batching per turn keeps the cost per request flat: under load a turn serves
many requests, and a message costs about as much as a request's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from actors.router.bookings import DECODER, ENCODER, Booked, BookingBatch, RemoteBookings
from actors.router.kv_router import KvRouter
from bus.connection import flush_in_order
from bus.context import BusContext

log = logging.getLogger(__name__)

Worker = tuple[str, int]

# a lost ``finished`` (a bus outage) must not load a worker forever: swept this often
SWEEP_INTERVAL = 60.0


class SharedRoutingView:
    def __init__(self, bus: BusContext, router: KvRouter, instance: str) -> None:
        self.bus = bus
        self.router = router
        self.instance = instance
        self.remote = RemoteBookings(router, instance)
        self._batch = BookingBatch(instance, secrets.token_hex(4))
        self._flushing = False
        self._sub: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._own = bus.subjects.router_bookings(instance)

    async def start(self) -> None:
        """Subscribe to the other frontends' bookings, then publish ours."""
        sj = self.bus.subjects
        self._sub = await self.bus.nc.subscribe(sj.router_bookings_all(), cb=self._on_batch)
        await flush_in_order(self.bus.nc)  # the server has the subscription: what others book from now on arrives
        r = self.router
        r.on_booked, r.on_first, r.on_finished = self._booked, self._first, self._finished
        self._sweeper = asyncio.create_task(self._sweep(), name="router-bookings-sweep")
        log.info("router: sharing bookings on %s (epoch %s)", sj.router_bookings(self.instance), self._batch.epoch)

    async def stop(self) -> None:
        r = self.router
        r.on_booked = r.on_first = r.on_finished = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as e:  # noqa: BLE001 - a closed connection has no subscription left
                log.debug("bookings unsubscribe: %s", e)
            self._sub = None

    # ---- ours, out -----------------------------------------------------------------------------
    def _booked(self, request_id: str, worker: Worker, n_tokens: int, overlap: int, seqs: list[int],
                session: str | None) -> None:
        self._batch.booked.append(Booked(request_id, worker[0], worker[1], n_tokens, overlap, seqs, session))
        self._schedule()

    def _first(self, request_id: str) -> None:
        self._batch.first.append(request_id)
        self._schedule()

    def _finished(self, request_id: str) -> None:
        self._batch.finished.append(request_id)
        self._schedule()

    def _schedule(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        batch = self._batch
        if not batch:
            return
        self._batch = BookingBatch(batch.origin, batch.epoch)
        data = ENCODER.encode(batch)
        asyncio.get_running_loop().create_task(self._publish(data))

    async def _publish(self, data: bytes) -> None:
        try:
            await self.bus.nc.publish(self.bus.subjects.router_bookings(self.instance), data)
        except Exception as e:  # noqa: BLE001 - the others see our load in the workers' reports
            log.debug("bookings not published: %s", e)

    # ---- theirs, in ----------------------------------------------------------------------------
    async def _on_batch(self, msg: Msg) -> None:
        if msg.subject == self._own:
            return  # our own, echoed back
        try:
            batch = DECODER.decode(msg.data)
        except Exception as e:  # noqa: BLE001 - a malformed message is dropped, never fatal
            log.warning("router: malformed booking batch on %s: %s", msg.subject, e)
            return
        self.remote.apply(batch)

    def forget_origin(self, origin: str) -> None:
        self.remote.forget_origin(origin)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            self.router.load.sweep()
