"""Streaming request/reply over NATS (the generate path) and the wire helpers shared with ``bus.rpc``.

Protocol (all control in headers, payload is only the chunk):
- caller publishes the request with ``reply=<inbox>.<token>`` and the headers ``Request-Id`` and
  ``Stall-Timeout``; ``<inbox>.*`` is one wildcard subscription per connection (:class:`_InboxMux`,
  like nats-py's own ``request()``), so a request is a single PUB, with no SUB/UNSUB per call;
- responder sends data chunks with ``Seq`` = 1, 2, ...; while idle it sends heartbeats
  (``Stream-Control: hb``, ``Seq`` = chunks sent so far); it ends with ``Stream-Control: eos`` and
  ``Seq`` = n + 1 (so a lost last chunk is a gap too), or with an error message carrying
  ``Nats-Service-Error``/``-Code``. Its first message carries ``Instance-Id`` and ``Cancel-Subject``.
- the caller says ``Stream-Batch: 1``: what several of its streams got from one responder connection
  in one loop turn (an engine step) may arrive as one batch message (``bus.stream_batch``), whose
  pieces are exactly the messages above;
- caller turns a 503 status (no responders), a Seq gap and silence longer than the stall timeout into
  Unavailable, StreamGap and StreamStalled; if it stops early it publishes ``Request-Id`` to the
  responder's ``Cancel-Subject``.
- caller-gone detection without extra round trips: the responder publishes every chunk and
  heartbeat with a reply subject of its own. When the caller's process is gone its inbox has no
  subscriber any more, and the server answers that reply subject with a 503 "no responders"
  status. When the caller's process lives on but the call is over (it closed before learning the
  cancel subject, or stopped on a gap), the caller's inbox mux answers a message for an unknown
  token itself, with ``Stream-Control: gone``. Either way the responder then stops iterating the
  generator (aclose), so the engine request is aborted within one heartbeat interval.
- responder-gone detection, the mirror image: when a stream has been silent for a little more
  than one heartbeat interval, the caller sends a request to that same reply subject. A live
  responder's process answers it; a dead one (SIGKILLed worker) has no subscription left, so the
  server says "no responders" at once and the caller raises StreamStalled without waiting out the
  whole stall timeout. A responder that is alive but silent still gets the full stall timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import RemoteError, ResponderGone, StreamGap, StreamStalled, Unavailable
from bus.stream_batch import BATCH_DECODER, Piece
from bus.tasks import honouring_cancel
from bus.wire import (
    DEFAULT_STALL,
    HEARTBEAT_FRACTION,
    NO_RESPONDERS,
    STATUS,
    decode_payload,
    encode_payload,
    raise_if_error,
)

log = logging.getLogger(__name__)


# --- caller side ------------------------------------------------------------------------------------
class StreamCall:
    """Async iterator over one streamed reply; ``instance`` names the responder once it answered.

    Stopping early (``aclose()``, ``break`` followed by garbage collection, task cancellation)
    publishes a cancel to the responder. Also an async context manager (closes on exit).
    """

    def __init__(self, nc: Client, subject: str, payload: Any, *, stall_timeout: float, msgpack: bool,
                 chunk_type: Any, headers: dict[str, str] | None) -> None:
        self.subject = subject
        self.request_id = nc._nuid.next().decode()
        self.instance: str | None = None
        self.cancel_subject: str | None = None
        self.received = 0
        self._gen = self._run(nc, payload, stall_timeout, msgpack, chunk_type, headers)

    def __aiter__(self) -> StreamCall:
        return self

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def __aenter__(self) -> StreamCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, nc: Client, payload: Any, stall: float, msgpack: bool, chunk_type: Any,
                   headers: dict[str, str] | None) -> AsyncIterator[Any]:
        hdrs = codec.headers_for(msgpack)
        if headers:
            hdrs.update(headers)
        hdrs[S.REQUEST_ID] = self.request_id
        hdrs[S.STALL_TIMEOUT] = f"{stall:g}"
        hdrs[S.STREAM_BATCH] = "1"  # this inbox takes batched stream messages (bus.stream_batch)
        mux = _inbox_mux(nc)
        if not mux.ready:
            await asyncio.shield(mux.started)
        inbox, box = mux.open()
        finished = False
        try:
            await nc.publish(self.subject, encode_payload(payload, msgpack), reply=inbox, headers=hdrs)
            loop = asyncio.get_running_loop()
            # a live responder beats every stall/3 seconds: after a bit more silence than that, ask
            # whether its process still exists
            probe_after = min(stall, stall * HEARTBEAT_FRACTION * 1.2)
            responder: str | None = None
            last = loop.time()
            while True:
                silent = loop.time() - last
                wait = stall - silent if responder is None else min(stall - silent, probe_after)
                msg = await box.get(max(wait, 0.001))
                if msg is None:  # timed out
                    silent = loop.time() - last
                    if silent < stall and responder is not None:
                        if not await _responder_alive(nc, responder, min(1.0, stall - silent)):
                            raise ResponderGone(f"stream on {self.subject}: responder gone after seq "
                                                f"{self.received}")
                        continue
                    if await _unread_arrived(nc, box, min(stall, 1.0)):
                        continue  # this process stood still, not the responder: read on
                    raise StreamStalled(f"stream on {self.subject} stalled: nothing for {stall:g}s "
                                        f"after seq {self.received}")
                last = loop.time()
                if type(msg) is Piece:  # one stream message of a batch (bus.stream_batch)
                    reply: str | None = msg.gone
                    h = msg.headers or _NO_HEADERS
                    seq: int | str | None = msg.seq
                    ctl = msg.ctl
                    data = msg.data
                    ct_headers = _MSGPACK if msg.msgpack else _JSON
                else:
                    reply = msg.reply
                    h = msg.headers or _NO_HEADERS
                    seq = h.get(S.SEQ)
                    ctl = h.get(S.STREAM_CONTROL)
                    data = msg.data
                    ct_headers = h
                    if h.get(STATUS) == NO_RESPONDERS:
                        finished = True
                        raise Unavailable(f"no responders on {self.subject}")
                if reply and responder is None:
                    responder = reply
                if h is not _NO_HEADERS:
                    if self.instance is None and S.INSTANCE_ID in h:
                        self.instance = h[S.INSTANCE_ID]
                    if self.cancel_subject is None and S.CANCEL_SUBJECT in h:
                        self.cancel_subject = h[S.CANCEL_SUBJECT]
                    if S.SERVICE_ERROR in h or S.SERVICE_ERROR_CODE in h:
                        finished = True
                        raise_if_error(h)
                if ctl is not None:
                    if seq is not None:
                        expect = self.received + 1 if ctl == S.EOS else self.received
                        if _seq(seq, self.subject) != expect:
                            raise StreamGap(f"stream on {self.subject}: {ctl} at seq {seq}, "
                                            f"received {self.received} chunks")
                    if ctl == S.EOS:
                        finished = True
                        return
                    continue  # heartbeat
                if seq is None:
                    raise RemoteError(f"stream on {self.subject}: chunk without {S.SEQ} header", 502)
                if _seq(seq, self.subject) != self.received + 1:
                    raise StreamGap(f"stream on {self.subject}: got seq {seq}, expected {self.received + 1}")
                self.received += 1
                yield decode_payload(data, ct_headers, chunk_type)
        finally:
            if not finished and self.cancel_subject and not nc.is_closed:
                try:
                    await nc.publish(self.cancel_subject, b"", headers={S.REQUEST_ID: self.request_id})
                except Exception as e:  # best effort: the responder also notices the inbox is gone
                    log.debug("cancel publish failed: %s", e)
            mux.close(inbox)


_NO_HEADERS: dict[str, str] = {}
_MSGPACK = {S.CONTENT_TYPE: S.CT_MSGPACK}
_JSON = {S.CONTENT_TYPE: S.CT_JSON}


def _seq(value: int | str, subject: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise RemoteError(f"stream on {subject}: bad {S.SEQ} {str(value)[:32]!r}", 502) from None


class _CallInbox:
    """Messages of one stream call, filled by the mux. ``get`` waits on a future; the timeout is one
    timer per call, armed once and moved only when a wait needs an earlier deadline (a stream that
    keeps up waits once per token: a timer made and cancelled per wait cost more than the wait)."""

    __slots__ = ("msgs", "waiter", "closed", "_timer", "_deadline")

    def __init__(self) -> None:
        self.msgs: collections.deque[Msg | Piece | None] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False  # the connection closed: get() raises ConnectionClosedError
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # loop time at which the current wait gives up

    def put(self, msg: Msg | Piece | None) -> None:
        self.msgs.append(msg)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self, timeout: float) -> Msg | Piece | None:
        """The next message, or None after ``timeout`` seconds without one."""
        if not self.msgs:
            loop = asyncio.get_running_loop()
            self._deadline = deadline = loop.time() + timeout
            t = self._timer
            if t is None or t.when() > deadline:
                if t is not None:
                    t.cancel()
                self._timer = loop.call_at(deadline, self._expire, loop)
            w = self.waiter = loop.create_future()
            try:
                await w
            finally:
                self.waiter = None
            if not self.msgs:
                return None
        msg = self.msgs.popleft()
        if msg is None and self.closed:
            raise nats.errors.ConnectionClosedError
        return msg

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: ends the wait whose deadline it is, else moves on to the current deadline."""
        self._timer = None
        w = self.waiter
        if w is None or w.done():
            return  # no wait now: the next one arms a timer again
        # loop clocks tick in milliseconds (uvloop): a timer may fire a hair before its time
        if loop.time() >= self._deadline - 0.001:
            w.set_result(None)
        else:
            self._timer = loop.call_at(self._deadline, self._expire, loop)

    def stop_timer(self) -> None:
        """The call is over: its timer must not keep it (and a wake-up) alive until it fires."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _InboxMux:
    """One wildcard inbox subscription per connection for every stream call made on it.

    A call owns the subject ``<prefix>.<token>`` while it runs. A message for a token with no open
    call (the caller stopped on a gap, closed early before learning the cancel subject, ...) is
    answered with ``Stream-Control: gone`` on its reply subject, which is what the server's
    "no responders" did when every call had its own subscription: the responder stops.
    """

    def __init__(self, nc: Client) -> None:
        # no reference to nc is kept: _inbox_muxes is keyed weakly by it
        self.prefix = nc.new_inbox() + "."
        self.calls: dict[str, _CallInbox] = {}
        self.ready = False
        self._n = 0
        self.started = asyncio.ensure_future(self._subscribe(nc))

    async def _subscribe(self, nc: Client) -> None:
        sub = await nc.subscribe(self.prefix + "*", cb=self._on_msg, pending_msgs_limit=-1,
                                 pending_bytes_limit=-1)
        # nats-py cancels a subscription's task when the connection closes (not on reconnects):
        # wake every open call then, as a per-call next_msg() used to raise ConnectionClosedError
        task = getattr(sub, "_wait_for_msgs_task", None)
        if task is not None:
            task.add_done_callback(self._on_closed)
        self.ready = True

    def _on_closed(self, _task: object) -> None:
        self.ready = False  # the next call on this connection builds a new mux
        for box in self.calls.values():
            box.closed = True
            box.put(None)

    def open(self) -> tuple[str, _CallInbox]:
        self._n += 1
        token = str(self._n)
        box = self.calls[token] = _CallInbox()
        return self.prefix + token, box

    def close(self, inbox: str) -> None:
        box = self.calls.pop(inbox[len(self.prefix):], None)
        if box is not None:
            box.stop_timer()

    async def _on_msg(self, msg: Msg) -> None:
        token = msg.subject[len(self.prefix):]
        box = self.calls.get(token)
        if box is not None:
            box.put(msg)
        elif token == S.BATCH_TOKEN:
            await self._on_batch(msg)
        elif msg.reply and not msg._client.is_closed:
            await msg._client.publish(msg.reply, b"", headers={S.STREAM_CONTROL: S.GONE})

    async def _on_batch(self, msg: Msg) -> None:
        try:
            pieces = BATCH_DECODER.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # not from a responder of ours: its streams (if any) see a gap or a stall
            log.warning("undecodable stream batch on %s (%d bytes): %s", msg.subject, len(msg.data), e)
            return
        calls = self.calls
        for piece in pieces:
            box = calls.get(piece.token)
            if box is not None:
                box.put(piece)
            elif piece.gone and not msg._client.is_closed:
                await msg._client.publish(piece.gone, b"", headers={S.STREAM_CONTROL: S.GONE})


_inbox_muxes: weakref.WeakKeyDictionary[Client, _InboxMux] = weakref.WeakKeyDictionary()


def _inbox_mux(nc: Client) -> _InboxMux:
    m = _inbox_muxes.get(nc)
    if m is None or (m.started.done() and not m.ready):  # none yet, or its subscribe failed
        m = _inbox_muxes[nc] = _InboxMux(nc)
    return m


async def _unread_arrived(nc: Client, box: _CallInbox, timeout: float) -> bool:
    """Whether messages for this call had reached this process unread when its wait ran out.

    Silence is judged by a timer of this process's event loop. When the process stood still (a
    blocking call, a starved CPU, a GC pause) for longer than the stall timeout, the overdue timer
    fires in the same loop turn that finds the socket readable, before the connection's reader task
    has run: what the responder sent meanwhile is unread, and the stream would be called stalled.
    So before a stall is declared, a PING: the server answers it after everything it sent before,
    and the reader hands those messages to the mux's subscription task before the PONG resolves the
    flush. A real stall costs one round trip more."""
    try:
        await honouring_cancel(nc.flush(timeout=timeout))
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - cut off from the server: nothing more can arrive now
        return bool(box.msgs)
    await asyncio.sleep(0)  # the subscription task, woken before the PONG, puts them in the box
    return bool(box.msgs)


async def _responder_alive(nc: Client, subject: str, timeout: float) -> bool:
    """False when the server says nobody is subscribed (the responder's process is gone) or the
    responder's process says it no longer runs this stream."""
    try:
        reply = await honouring_cancel(nc.request(subject, b"", timeout=timeout))
    except nats.errors.NoRespondersError:
        return False
    except Exception:  # slow or unsure: let the stall timeout decide
        return True
    return (reply.headers or {}).get(S.STREAM_CONTROL) != S.GONE


def stream_request(nc: Client, subject: str, payload: Any, *, stall_timeout: float = DEFAULT_STALL,
                   msgpack: bool = True, chunk_type: Any = None,
                   headers: dict[str, str] | None = None) -> StreamCall:
    """Start a streamed request; iterate the result for decoded chunks (see module doc)."""
    return StreamCall(nc, subject, payload, stall_timeout=stall_timeout, msgpack=msgpack,
                      chunk_type=chunk_type, headers=headers)
