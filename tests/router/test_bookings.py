"""One routing view across frontends: another frontend's bookings, applied as remote bookings."""

from __future__ import annotations

import random

from actors.router.bookings import DECODER, ENCODER, Booked, BookingBatch, RemoteBookings
from actors.router.cost import RouterConfig
from actors.router.kv_router import KvRouter

BS = 4
WORKERS = [("w0", 0), ("w1", 0), ("w2", 0), ("w3", 0)]


def _router() -> KvRouter:
    return KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))


def _tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10_000) for _ in range(blocks * BS)]


class Origin:
    """A frontend whose router's bookings are collected into batches, as shared_view sends them."""

    def __init__(self, name: str, epoch: str = "e1") -> None:
        self.router = _router()
        self.batch = BookingBatch(name, epoch)
        r = self.router
        r.on_booked = lambda rid, w, n, overlap, seqs, session: self.batch.booked.append(
            Booked(rid, w[0], w[1], n, overlap, seqs, session))
        r.on_first = lambda rid: self.batch.first.append(rid)
        r.on_finished = lambda rid: self.batch.finished.append(rid)

    def take(self) -> BookingBatch:
        """The batch as another frontend decodes it off the bus."""
        batch, self.batch = self.batch, BookingBatch(self.batch.origin, self.batch.epoch)
        return DECODER.decode(ENCODER.encode(batch))


def test_a_follow_up_routed_by_another_frontend_goes_where_the_first_was_booked() -> None:
    a, b = Origin("fa"), _router()
    remote = RemoteBookings(b, "fb")
    prompt = _tokens(1, 6)
    first = a.router.route(prompt, WORKERS, request_id="r1")
    remote.apply(a.take())
    assert b.load.prefill_tokens(first.worker) == 24  # a's request loads the worker in b's view too
    a.router.finish("r1")
    remote.apply(a.take())
    # no KV event yet: only the booking tells b where the prefix went
    follow = b.route(prompt + _tokens(2, 2), WORKERS, request_id="r2")
    assert follow.worker == first.worker and follow.overlap_blocks == 6


def test_remote_load_ends_with_first_token_and_finish() -> None:
    a, b = Origin("fa"), _router()
    remote = RemoteBookings(b, "fb")
    d = a.router.route(_tokens(3, 4), WORKERS, request_id="r1")
    remote.apply(a.take())
    assert b.load.prefill_tokens(d.worker) == 16 and b.load.running(d.worker) == 1
    a.router.first_token("r1")
    remote.apply(a.take())
    assert b.load.prefill_tokens(d.worker) == 0 and b.load.running(d.worker) == 1
    a.router.finish("r1")
    remote.apply(a.take())
    assert b.load.running(d.worker) == 0 and remote.stats() == {"fa": 0}


def test_a_session_bound_by_one_frontend_is_bound_in_the_other() -> None:
    a, b = Origin("fa"), _router()
    remote = RemoteBookings(b, "fb")
    d = a.router.route(_tokens(4, 2), WORKERS, request_id="r1", session="s1")
    remote.apply(a.take())
    assert b.sessions.bound("s1") == d.worker


def test_a_restarted_or_vanished_frontend_books_nothing_any_more() -> None:
    a, b = Origin("fa"), _router()
    remote = RemoteBookings(b, "fb")
    d = a.router.route(_tokens(5, 4), WORKERS, request_id="r1")
    remote.apply(a.take())
    assert b.load.running(d.worker) == 1
    # the same frontend started again (SIGKILLed, restarted): a new epoch drops the old run's bookings
    again = Origin("fa", epoch="e2")
    remote.apply(again.take())
    assert b.load.running(d.worker) == 0
    d2 = again.router.route(_tokens(6, 4), WORKERS, request_id="r2")
    remote.apply(again.take())
    assert b.load.running(d2.worker) == 1
    remote.forget_origin("fa")  # its registry record went
    assert b.load.running(d2.worker) == 0 and remote.stats() == {}


def test_own_batches_are_ignored() -> None:
    a = Origin("fa")
    remote = RemoteBookings(a.router, "fa")
    d = a.router.route(_tokens(7, 4), WORKERS, request_id="r1")
    remote.apply(a.take())
    assert a.router.load.running(d.worker) == 1  # booked once, not twice
