"""Responder side of streaming RPC (see ``bus.stream`` for the protocol): Seq-numbered chunks,
heartbeats, end-of-stream and error messages, caller-gone detection, and cancellation by request id."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.connection import settling
from bus.errors import ActorError, BadRequest
from bus.stream_batch import Outbox, Piece, plain_headers
from bus.wire import DEFAULT_STALL, HEARTBEAT_FRACTION, NO_RESPONDERS, STATUS, encode_payload, error_headers

log = logging.getLogger(__name__)


class _GoneMux:
    """One wildcard subscription per connection collecting 'no responders' for stream replies, and
    the connection's ``Outbox`` of batched stream messages (``bus.stream_batch``)."""

    def __init__(self, nc: Client) -> None:
        self.prefix = nc.new_inbox()
        self.waiters: dict[str, Callable[[], None]] = {}  # a stream's reply subject -> its "gone" callback
        self._n = 0
        self._ready = asyncio.ensure_future(self._subscribe(nc))
        self.outbox = Outbox(nc, self.caller_reply)
        # batching callers: inbox prefix -> (the reply subject of its batches, its streams' subjects)
        self._callers: dict[str, tuple[str, set[str]]] = {}
        self._caller_of: dict[str, str] = {}  # batch reply subject -> inbox prefix

    async def _subscribe(self, nc: Client) -> None:
        await nc.subscribe(self.prefix + ".*", cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        h = msg.headers
        if h and h.get(STATUS) == NO_RESPONDERS and settling(msg._client):
            # right after a bus restart the caller may not have re-subscribed its inbox yet: keep
            # streaming; what it missed shows up as a gap and it re-sends the rest
            return
        caller = self._caller_of.get(msg.subject)
        if caller is not None:
            # a batch found no subscriber: the caller's process is gone, and so is every stream of it
            if h and h.get(STATUS) == NO_RESPONDERS:
                for subject in list(self._callers[caller][1]):
                    on_gone = self.waiters.get(subject)
                    if on_gone is not None:
                        on_gone()
            return
        if h and (h.get(STATUS) == NO_RESPONDERS or h.get(S.STREAM_CONTROL) == S.GONE):
            on_gone = self.waiters.get(msg.subject)
            if on_gone is not None:
                on_gone()
        elif msg.reply:
            # a caller's liveness probe: this process is here; say whether that stream still is
            # (one this process dropped would otherwise leave its caller waiting a whole stall timeout)
            gone = None if msg.subject in self.waiters else {S.STREAM_CONTROL: S.GONE}
            await msg._client.publish(msg.reply, b"", headers=gone)

    async def register(self, on_gone: Callable[[], None]) -> str:
        await asyncio.shield(self._ready)
        self._n += 1
        subject = f"{self.prefix}.{self._n}"
        self.waiters[subject] = on_gone
        return subject

    def caller_reply(self, caller: str) -> str:
        return self._callers[caller][0]

    def join(self, caller: str, subject: str) -> None:
        """A batching stream (reply subject ``subject``) of the caller with inbox prefix ``caller``."""
        entry = self._callers.get(caller)
        if entry is None:
            self._n += 1
            entry = self._callers[caller] = (f"{self.prefix}.c{self._n}", set())
            self._caller_of[entry[0]] = caller
        entry[1].add(subject)

    def leave(self, caller: str, subject: str) -> None:
        entry = self._callers.get(caller)
        if entry is None:
            return
        entry[1].discard(subject)
        if not entry[1]:
            del self._callers[caller]
            del self._caller_of[entry[0]]


_muxes: weakref.WeakKeyDictionary[Client, _GoneMux] = weakref.WeakKeyDictionary()


def _mux(nc: Client) -> _GoneMux:
    m = _muxes.get(nc)
    if m is None:
        m = _muxes[nc] = _GoneMux(nc)
    return m


def request_id(msg: Msg) -> str:
    return (msg.headers or {}).get(S.REQUEST_ID) or msg._client._nuid.next().decode()


def heartbeat_interval(msg: Msg, heartbeat: float | None) -> float:
    try:
        stall = float((msg.headers or {}).get(S.STALL_TIMEOUT, DEFAULT_STALL))
    except ValueError:
        stall = DEFAULT_STALL
    # a caller's header, so anything can arrive: "nan" or "0" would mean a heartbeat every 10 ms for
    # the life of the stream, "inf" none at all, and heartbeats are how a vanished caller is noticed
    if not math.isfinite(stall) or stall <= 0:
        stall = DEFAULT_STALL
    hb = max(0.01, stall * HEARTBEAT_FRACTION)
    return min(hb, heartbeat) if heartbeat else hb


async def respond_stream(nc: Client, msg: Msg, chunks: AsyncIterator[Any], *,
                         cancel_subject: str | None = None, instance: str | None = None,
                         heartbeat: float | None = None, msgpack: bool | None = None) -> BaseException | None:
    """Send ``chunks`` to the caller of ``msg``. Returns the error that ended the stream (already sent
    to the caller) or None. Cancelling this coroutine (caller's cancel) closes ``chunks``."""
    reply = msg.reply
    if not reply:  # fire-and-forget publish: nobody to stream to
        await _aclose(chunks)
        return None
    mp = codec.is_msgpack(msg.headers) if msgpack is None else msgpack
    hb = heartbeat_interval(msg, heartbeat)
    mux = _mux(nc)
    # One task per stream, the caller's: the chunks are produced here, a heartbeat is a timer, and
    # a caller found gone cancels this task (three tasks and an asyncio.wait per request before)
    task = asyncio.current_task()
    assert task is not None
    state = {"seq": 0, "last": time.monotonic(), "first": True, "gone": False, "ending": False}

    def on_gone() -> None:
        if not state["gone"] and not state["ending"]:
            state["gone"] = True
            task.cancel()

    gone_subject = await mux.register(on_gone)
    first: dict[str, str] = {}
    if instance:
        first[S.INSTANCE_ID] = instance
    if cancel_subject:
        first[S.CANCEL_SUBJECT] = cancel_subject
    caller, _, token = reply.rpartition(".")
    batching = bool(caller) and (msg.headers or {}).get(S.STREAM_BATCH) == "1"
    if batching:
        mux.join(caller, gone_subject)

    def piece(data: bytes, seq: int, ctl: str | None, extra: dict[str, str] | None) -> Piece:
        if state["first"]:
            extra = {**first, **(extra or {})} if first else extra
            state["first"] = False
        state["last"] = time.monotonic()
        return Piece(token, seq, gone_subject, data, ctl, extra or None, mp)

    async def send(data: bytes, seq: int, ctl: str | None = None, extra: dict[str, str] | None = None) -> None:
        p = piece(data, seq, ctl, extra)
        if batching:
            mux.outbox.put(reply, p)
        else:
            await nc.publish(reply, data, reply=gone_subject, headers=plain_headers(p))

    async def produce() -> BaseException | None:
        try:
            async for chunk in chunks:
                state["seq"] += 1
                await send(encode_payload(chunk, mp), state["seq"])
            await send(b"", state["seq"] + 1, S.EOS)
            return None
        except ActorError as e:
            await send(b"", state["seq"] + 1, extra=error_headers(e))
            return e
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            log.exception("stream on %s failed", msg.subject)
            err = ActorError(f"internal error: {type(e).__name__}: {e}")
            await send(b"", state["seq"] + 1, extra=error_headers(err))
            return e

    loop = asyncio.get_running_loop()
    beats: list[asyncio.Future[None]] = []

    def beat() -> None:
        timer[0] = loop.call_later(hb, beat)
        if time.monotonic() - state["last"] < hb * 0.9 or nc.is_closed:
            return
        if batching:
            mux.outbox.put(reply, piece(b"", state["seq"], S.HEARTBEAT, None))
        else:
            f = asyncio.ensure_future(send(b"", state["seq"], S.HEARTBEAT))
            beats.append(f)
            f.add_done_callback(_forget_beat(beats))

    timer = [loop.call_later(hb, beat)]
    try:
        result = await produce()
        state["ending"] = True
        if batching:
            await mux.outbox.drained()  # the last message leaves before the handler is done
        return result
    except asyncio.CancelledError:
        if not state["gone"]:
            raise  # the caller's cancel, a shutdown: not ours to swallow
        task.uncancel()
        log.info("stream on %s: caller gone after %d chunks; aborting", msg.subject, state["seq"])
        return None
    finally:
        state["ending"] = True
        timer[0].cancel()
        for f in beats:
            f.cancel()
        mux.waiters.pop(gone_subject, None)
        if batching:
            mux.leave(caller, gone_subject)
        await _aclose(chunks)


def _forget_beat(beats: list[asyncio.Future[None]]) -> Callable[[asyncio.Future[None]], None]:
    def done(f: asyncio.Future[None]) -> None:
        if f in beats:
            beats.remove(f)
        if not f.cancelled() and f.exception() is not None:
            log.debug("heartbeat not sent: %s", f.exception())
    return done


async def _aclose(chunks: Any) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception as e:
            log.debug("closing stream generator: %s", e)


MAX_REQUEST_ID = 256  # stream request ids are 22-character nuids


class StreamCancels:
    """Request-id -> task map behind one cancel subject (an actor's ``cancel`` endpoint)."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.cancelled = 0

    def track(self, rid: str, task: asyncio.Task[Any]) -> None:
        self.tasks[rid] = task
        task.add_done_callback(lambda _t: self.tasks.pop(rid, None))

    def cancel(self, rid: str) -> bool:
        task = self.tasks.get(rid)
        if task is None or task.done():
            return False
        self.cancelled += 1
        task.cancel()
        return True

    async def handle(self, msg: Msg) -> None:
        """Message handler for the cancel subject (Request-Id header, or the id as payload)."""
        rid = (msg.headers or {}).get(S.REQUEST_ID) or msg.data.decode(errors="replace").strip().strip('"')
        if len(rid) > MAX_REQUEST_ID:  # none of ours; echoed back, it could exceed max_payload
            raise BadRequest(f"cancel: a request id has at most {MAX_REQUEST_ID} characters, got {len(rid)}")
        found = self.cancel(rid)
        if msg.reply:
            await msg._client.publish(msg.reply, codec.encode({"cancelled": found, "request_id": rid}),
                                      headers=codec.headers_for(False))
