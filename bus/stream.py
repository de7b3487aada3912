"""Streaming request/reply over NATS (the generate path) and the wire helpers shared with ``bus.rpc``.

Protocol (all control in headers, payload is only the chunk):
- caller publishes the request with ``reply=<inbox>.<token>`` and the headers ``Request-Id`` and
  ``Stall-Timeout``; ``<inbox>.*`` is one wildcard subscription per connection (:class:`_InboxMux`,
  like nats-py's own ``request()``), so a request is a single PUB, with no SUB/UNSUB per call;
- responder sends data chunks with ``Seq`` = 1, 2, ...; while idle it sends heartbeats
  (``Stream-Control: hb``, ``Seq`` = chunks sent so far); it ends with ``Stream-Control: eos`` and
  ``Seq`` = n + 1 (so a lost last chunk is a gap too), or with an error message carrying
  ``Nats-Service-Error``/``-Code``. Its first message carries ``Instance-Id`` and ``Cancel-Subject``.
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
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import ActorError, RemoteError, StreamGap, StreamStalled, Unavailable, error_from_code

log = logging.getLogger(__name__)

STATUS = "Status"  # nats-py puts the server's inline status (e.g. 503 no responders) here
NO_RESPONDERS = "503"
DEFAULT_STALL = 10.0
HEARTBEAT_FRACTION = 1 / 3  # heartbeat at a third of the caller's stall timeout

_decoders: dict[tuple[bool, Any], Any] = {}


# --- wire helpers (shared with bus.rpc) -----------------------------------------------------------
def decode_payload(data: bytes, headers: Mapping[str, str] | None, type: Any = None) -> Any:
    """Decode by Content-Type with cached typed decoders (hot path of streams)."""
    if type is None:
        return codec.decode(data, headers)
    mp = codec.is_msgpack(headers)
    dec = _decoders.get((mp, type))
    if dec is None:
        dec = (msgspec.msgpack.Decoder if mp else msgspec.json.Decoder)(type)
        _decoders[(mp, type)] = dec
    if not data and not mp:
        data = b"{}"
    try:
        return dec.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return codec.decode(data, headers, type)  # raises BadRequest with the precise message


def encode_payload(payload: Any, msgpack: bool) -> bytes:
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    return codec.encode(payload, msgpack=msgpack)


def error_headers(err: ActorError, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    h = {S.SERVICE_ERROR: err.message or type(err).__name__, S.SERVICE_ERROR_CODE: str(err.code)}
    if extra:
        h.update(extra)
    return h


def raise_if_error(headers: Mapping[str, str] | None) -> None:
    """Turn a service-error or no-responders message into the typed exception."""
    if not headers:
        return
    if headers.get(STATUS) == NO_RESPONDERS:
        raise Unavailable("no responders")
    desc = headers.get(S.SERVICE_ERROR)
    if desc is not None or S.SERVICE_ERROR_CODE in headers:
        try:
            code = int(headers.get(S.SERVICE_ERROR_CODE, "500"))
        except ValueError:
            code = 500
        raise error_from_code(desc or "remote error", code)


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
                            raise StreamStalled(f"stream on {self.subject}: responder gone after seq "
                                                f"{self.received}")
                        continue
                    raise StreamStalled(f"stream on {self.subject} stalled: nothing for {stall:g}s "
                                        f"after seq {self.received}")
                last = loop.time()
                if msg.reply and responder is None:
                    responder = msg.reply
                h = msg.headers or {}
                if self.instance is None and S.INSTANCE_ID in h:
                    self.instance = h[S.INSTANCE_ID]
                if self.cancel_subject is None and S.CANCEL_SUBJECT in h:
                    self.cancel_subject = h[S.CANCEL_SUBJECT]
                if h.get(STATUS) == NO_RESPONDERS:
                    finished = True
                    raise Unavailable(f"no responders on {self.subject}")
                if S.SERVICE_ERROR in h or S.SERVICE_ERROR_CODE in h:
                    finished = True
                    raise_if_error(h)
                seq_s = h.get(S.SEQ)
                ctl = h.get(S.STREAM_CONTROL)
                if ctl is not None:
                    if seq_s is not None:
                        expect = self.received + 1 if ctl == S.EOS else self.received
                        if int(seq_s) != expect:
                            raise StreamGap(f"stream on {self.subject}: {ctl} at seq {seq_s}, "
                                            f"received {self.received} chunks")
                    if ctl == S.EOS:
                        finished = True
                        return
                    continue  # heartbeat
                if seq_s is None:
                    raise RemoteError(f"stream on {self.subject}: chunk without {S.SEQ} header", 502)
                if int(seq_s) != self.received + 1:
                    raise StreamGap(f"stream on {self.subject}: got seq {seq_s}, expected {self.received + 1}")
                self.received += 1
                yield decode_payload(msg.data, h, chunk_type)
        finally:
            if not finished and self.cancel_subject and not nc.is_closed:
                try:
                    await nc.publish(self.cancel_subject, b"", headers={S.REQUEST_ID: self.request_id})
                except Exception as e:  # best effort: the responder also notices the inbox is gone
                    log.debug("cancel publish failed: %s", e)
            mux.close(inbox)


class _CallInbox:
    """Messages of one stream call, filled by the mux; ``get`` is a future plus a timer (cheaper
    than nats-py's ``next_msg``, which makes a task, a uuid4 and a ``wait_for`` per message)."""

    __slots__ = ("msgs", "waiter", "closed")

    def __init__(self) -> None:
        self.msgs: collections.deque[Msg | None] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False  # the connection closed: get() raises ConnectionClosedError

    def put(self, msg: Msg | None) -> None:
        self.msgs.append(msg)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self, timeout: float) -> Msg | None:
        """The next message, or None after ``timeout`` seconds without one."""
        if not self.msgs:
            loop = asyncio.get_running_loop()
            w = self.waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, w)
            try:
                await w
            finally:
                timer.cancel()
                self.waiter = None
            if not self.msgs:
                return None
        msg = self.msgs.popleft()
        if msg is None and self.closed:
            raise nats.errors.ConnectionClosedError
        return msg


def _wake(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_result(None)


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
        self.calls.pop(inbox[len(self.prefix):], None)

    async def _on_msg(self, msg: Msg) -> None:
        box = self.calls.get(msg.subject[len(self.prefix):])
        if box is not None:
            box.put(msg)
        elif msg.reply and not msg._client.is_closed:
            await msg._client.publish(msg.reply, b"", headers={S.STREAM_CONTROL: S.GONE})


_inbox_muxes: weakref.WeakKeyDictionary[Client, _InboxMux] = weakref.WeakKeyDictionary()


def _inbox_mux(nc: Client) -> _InboxMux:
    m = _inbox_muxes.get(nc)
    if m is None or (m.started.done() and not m.ready):  # none yet, or its subscribe failed
        m = _inbox_muxes[nc] = _InboxMux(nc)
    return m


async def _responder_alive(nc: Client, subject: str, timeout: float) -> bool:
    """False only when the server says nobody is subscribed (the responder's process is gone)."""
    try:
        await nc.request(subject, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        return False
    except Exception:  # slow or unsure: let the stall timeout decide
        pass
    return True


def stream_request(nc: Client, subject: str, payload: Any, *, stall_timeout: float = DEFAULT_STALL,
                   msgpack: bool = True, chunk_type: Any = None,
                   headers: dict[str, str] | None = None) -> StreamCall:
    """Start a streamed request; iterate the result for decoded chunks (see module doc)."""
    return StreamCall(nc, subject, payload, stall_timeout=stall_timeout, msgpack=msgpack,
                      chunk_type=chunk_type, headers=headers)


# --- responder side ---------------------------------------------------------------------------------
class _GoneMux:
    """One wildcard subscription per connection collecting 'no responders' for stream replies."""

    def __init__(self, nc: Client) -> None:
        self.prefix = nc.new_inbox()
        self.waiters: dict[str, asyncio.Event] = {}
        self._n = 0
        self._ready = asyncio.ensure_future(self._subscribe(nc))

    async def _subscribe(self, nc: Client) -> None:
        await nc.subscribe(self.prefix + ".*", cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        h = msg.headers
        if h and (h.get(STATUS) == NO_RESPONDERS or h.get(S.STREAM_CONTROL) == S.GONE):
            ev = self.waiters.get(msg.subject)
            if ev is not None:
                ev.set()
        elif msg.reply:  # a caller's liveness probe: this process is still here
            await msg._client.publish(msg.reply, b"")

    async def register(self) -> tuple[str, asyncio.Event]:
        await asyncio.shield(self._ready)
        self._n += 1
        subject = f"{self.prefix}.{self._n}"
        ev = asyncio.Event()
        self.waiters[subject] = ev
        return subject, ev


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
    gone_subject, gone = await _mux(nc).register()
    first: dict[str, str] = {}
    if instance:
        first[S.INSTANCE_ID] = instance
    if cancel_subject:
        first[S.CANCEL_SUBJECT] = cancel_subject
    ct = S.CT_MSGPACK if mp else S.CT_JSON
    state = {"seq": 0, "last": time.monotonic(), "first": True}

    async def send(data: bytes, h: dict[str, str]) -> None:
        if state["first"]:
            h.update(first)
            state["first"] = False
        await nc.publish(reply, data, reply=gone_subject, headers=h)
        state["last"] = time.monotonic()

    async def produce() -> BaseException | None:
        try:
            async for chunk in chunks:
                state["seq"] += 1
                await send(encode_payload(chunk, mp), {S.CONTENT_TYPE: ct, S.SEQ: str(state["seq"])})
            await send(b"", {S.STREAM_CONTROL: S.EOS, S.SEQ: str(state["seq"] + 1)})
            return None
        except ActorError as e:
            await send(b"", error_headers(e, {S.SEQ: str(state["seq"] + 1)}))
            return e
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            log.exception("stream on %s failed", msg.subject)
            err = ActorError(f"internal error: {type(e).__name__}: {e}")
            await send(b"", error_headers(err, {S.SEQ: str(state["seq"] + 1)}))
            return e

    async def beat() -> None:
        while True:
            await asyncio.sleep(hb)
            if time.monotonic() - state["last"] >= hb * 0.9:
                await send(b"", {S.STREAM_CONTROL: S.HEARTBEAT, S.SEQ: str(state["seq"])})

    producer = asyncio.ensure_future(produce())
    beater = asyncio.ensure_future(beat())
    gone_wait = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({producer, gone_wait}, return_when=asyncio.FIRST_COMPLETED)
        if producer.done():
            return producer.result()
        log.info("stream on %s: caller gone after %d chunks; aborting", msg.subject, state["seq"])
        return None
    finally:
        for t in (beater, gone_wait, producer):
            t.cancel()
        if not producer.done():
            await asyncio.gather(producer, return_exceptions=True)
        await asyncio.gather(beater, gone_wait, return_exceptions=True)
        await _aclose(chunks)
        mux = _muxes.get(nc)
        if mux is not None:
            mux.waiters.pop(gone_subject, None)


async def _aclose(chunks: Any) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception as e:
            log.debug("closing stream generator: %s", e)


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
        found = self.cancel(rid)
        if msg.reply:
            await msg._client.publish(msg.reply, codec.encode({"cancelled": found, "request_id": rid}),
                                      headers=codec.headers_for(False))


__all__ = ["StreamCall", "stream_request", "respond_stream", "StreamCancels", "decode_payload",
           "encode_payload", "error_headers", "raise_if_error", "request_id", "heartbeat_interval",
           "error_from_code"]
