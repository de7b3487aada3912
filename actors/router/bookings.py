"""One routing view across frontend processes: each frontend's bookings, as the others apply them.

A KV router books each decision at once (the request's load on its worker, its prompt's blocks as
predicted there, the session's binding) and the workers' KV events and load reports confirm it
later. Several frontends (``frontend.processes`` > 1, or frontends on several hosts) each see the
same events, but not each other's decisions: a follow-up routed by another frontend before the
events arrive, or a session whose turns reach different frontends, would be costed without them.
So every frontend publishes its bookings (``BookingBatch``, one message per loop turn, on
``<ns>.router.bookings.<instance>``) and applies every other frontend's as *remote* bookings: the
same load, predicted blocks and session binding, under the key ``<origin>/<request id>``.

Remote bookings end with their origin's ``finished`` entry, when the origin starts again (a new
``epoch``: what the dead process had booked is dropped at once) and when its registry record goes
(``forget_origin``). Their cost: N frontends each receive N-1 streams of batches, so this is for
a handful of frontends, not hundreds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from actors.router.kv_router import KvRouter

log = logging.getLogger(__name__)

Worker = tuple[str, int]


class Booked(msgspec.Struct, array_like=True, frozen=True):
    """One routing decision: ``hashes`` are the prompt's block hashes (sequence hashes), from the
    first block on; the receiver predicts on the worker those its own index does not hold."""

    request_id: str
    instance: str
    dp_rank: int
    prompt_tokens: int
    overlap_blocks: int
    hashes: list[int]
    session: str | None = None


class BookingBatch(msgspec.Struct, array_like=True):
    """What one frontend booked, saw prefill, and finished during one turn of its loop, in that
    order (a request booked and finished in one turn is applied in that order too)."""

    origin: str  # the frontend's instance (its registry key)
    epoch: str  # this start of that frontend: a new one drops what an older one had booked
    booked: list[Booked] = msgspec.field(default_factory=list)
    first: list[str] = msgspec.field(default_factory=list)  # request ids whose first token came
    finished: list[str] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.booked or self.first or self.finished)


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(BookingBatch)


class RemoteBookings:
    """Applies other frontends' batches to this frontend's router (pure logic: no NATS)."""

    def __init__(self, router: KvRouter, own: str) -> None:
        self.router = router
        self.own = own
        self._origins: dict[str, tuple[str, set[str]]] = {}  # origin -> (epoch, keys booked)
        self.applied = 0

    def apply(self, batch: BookingBatch) -> None:
        origin = batch.origin
        if origin == self.own:
            return
        held = self._origins.get(origin)
        if held is None or held[0] != batch.epoch:
            if held is not None:
                log.info("router: frontend %s started again; dropping %d bookings of its last run",
                         origin, len(held[1]))
                self._drop(held[1])
            held = self._origins[origin] = (batch.epoch, set())
        keys = held[1]
        router, load = self.router, self.router.load
        for b in batch.booked:
            key = f"{origin}/{b.request_id}"
            router.book_remote(key, (b.instance, b.dp_rank), b.prompt_tokens, b.overlap_blocks, b.hashes,
                               b.session)
            keys.add(key)
        for rid in batch.first:
            load.first_token(f"{origin}/{rid}")
        for rid in batch.finished:
            key = f"{origin}/{rid}"
            load.finish(key)
            keys.discard(key)
        self.applied += 1

    def forget_origin(self, origin: str) -> None:
        """The origin's registry record is gone: what it had booked ends."""
        held = self._origins.pop(origin, None)
        if held is not None and held[1]:
            log.info("router: frontend %s is gone; dropping its %d bookings", origin, len(held[1]))
            self._drop(held[1])

    def _drop(self, keys: Sequence[str] | set[str]) -> None:
        for key in keys:
            self.router.load.finish(key)

    def stats(self) -> dict[str, int]:
        return {origin: len(keys) for origin, (_, keys) in self._origins.items()}
