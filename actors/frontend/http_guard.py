"""HTTP hardening: timeouts, a connection limit and OpenAI-shaped errors for what aiohttp refuses itself.

aiohttp has no header timeout: a connection that never completes its request head is held until
its keep-alive timer (an hour by default), and its parser answers malformed requests in text/plain.
``GuardedSite`` serves the frontend's application through ``GuardedServer``, whose connections
(``GuardedConnection``) are always in one phase, with at most one timer:

- HEAD: request line and headers awaited. ``header_timeout`` counts from the connection's opening,
  or on a kept-alive connection from the first byte of the next request. It is a deadline, not an
  inactivity timer, so a header line every few seconds (slowloris) does not extend it. Expiry
  answers 408 and closes.
- HANDLER: a handler runs. No timer: a slow generation or a long SSE stream is never cut. The body
  read is bounded inside the handler by ``read_body`` (``body_timeout``, 408), and a response sent
  with the body not fully received closes the connection (what is left of the body is not read).
- IDLE: kept alive between requests. ``keepalive_timeout``, then a silent close: a 408 there would
  be read as the answer to whatever request the client is sending at that moment. At
  ``max_connections`` the oldest idle connection is closed to admit a new one; with none idle the
  new one gets 503 + Retry-After.
- CLOSING: an error answer is on its way. The connection reads and discards for ``LINGER_S`` so the
  kernel ends it with FIN, not RST (an RST can destroy the answer before the client has read it).

aiohttp (3.14) behaviour relied on, each covered by tests/frontend/test_http_guard.py:

- ``web.Server`` instances are the protocol factory ``TCPSite`` hands to ``loop.create_server``, so
  overriding ``__call__`` picks the connection class (every test fails otherwise).
- A ``RequestHandler`` calls its manager's ``request_factory(message, payload, protocol, writer,
  task)`` once per request head it takes from its queue, parse errors included, before any handler
  (test_kept_alive_connection_times_its_next_head_from_first_byte), then the manager's
  ``request_handler`` for a parsed request or its own ``handle_error(request, 400, exc)`` with an
  ``HttpProcessingError`` for one the parser refused (test_malformed_http_gets_openai_json).
- ``RequestHandler.force_close()`` closes the transport and ends the connection's read loop; a
  response with ``force_close()`` ends its connection once sent (test_body_trickle_gets_408).
- aiohttp's own keep-alive timer closes only a connection waiting for its next request; it stays
  on, at twice our longest timer, as a backstop (test_long_stream_is_not_cut).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.http import HttpProcessingError

from bus.errors import ActorError, BadRequest, ClientTimeout, Overloaded, PayloadTooLarge, RecoverableError
from config.topology import FrontendConfig

from .handoff import HandedConnections
from .metrics import FrontendMetrics
from .openai_io import RETRY_AFTER_S, error_body

log = logging.getLogger(__name__)

# How long an answered connection keeps reading (and dropping) what the client still sends before
# it is closed, and how long aiohttp drains a body a handler left unread (its default is 10 s, which a
# client trickling the rest of a body would get to hold a slot for).
LINGER_S = 2.0
# Parser messages quote the client's bytes (up to a whole 8 KiB line): keep the error body short.
_MESSAGE_CHARS = 200
_JSON = "application/json"

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
RequestFactory = Callable[..., web.BaseRequest]


class Phase(enum.Enum):
    HEAD = "head"
    HANDLER = "handler"
    IDLE = "idle"
    CLOSING = "closing"
    CLOSED = "closed"


def _error_headers(err: ActorError) -> dict[str, str]:
    """Every 503 says when to retry (an error may say how long itself: a failed wake)."""
    return {"Retry-After": getattr(err, "retry_after", RETRY_AFTER_S)} if err.code == 503 else {}


def raw_response(err: ActorError) -> bytes:
    """A complete HTTP/1.1 error response that closes its connection, for answers written straight
    to the transport (no request was parsed, so aiohttp has nothing to answer through)."""
    body = error_body(err)
    lines = [f"HTTP/1.1 {err.code} {HTTPStatus(err.code).phrase}", f"Content-Type: {_JSON}",
             f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in _error_headers(err).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


def json_error(err: ActorError, body: bytes | None = None) -> web.Response:
    """An error response: OpenAI's shape (what the HTTP surface answers with), or ``body``, the
    error in another API's shape (Anthropic's on /v1/messages)."""
    return web.Response(body=error_body(err) if body is None else body, status=err.code, content_type=_JSON,
                        headers=_error_headers(err))


class UnsupportedMediaType(RecoverableError, code=415, kind="invalid_request_error"):
    """A request body not declared as JSON (its Content-Type, or none)."""


# vllm serve's words (vllm/entrypoints/serve/utils/api_utils.py validate_json_request), which it
# sends with a 400 inside a pydantic-style "1 validation error:" message; 415 is HTTP's status for it
NOT_JSON = "Unsupported Media Type: Only 'application/json' is allowed"


def check_json_type(content_type: str | None) -> None:
    """Refuse a body whose Content-Type is not application/json, as vllm serve does on every POST
    route: the media type before any parameter, in any case (``; charset=utf-8`` is fine); a missing
    header, ``text/json`` or ``application/*+json`` are refused too. A header split, no body read."""
    if (content_type or "").split(";", 1)[0].strip().lower() != "application/json":
        raise UnsupportedMediaType(NOT_JSON)


async def read_body(request: web.BaseRequest, timeout: float, limit: int, metrics: FrontendMetrics) -> bytes:
    """The request body, which every POST route here reads as JSON: not declared so, it is a 415
    before anything is read (``check_json_type``). Received within ``timeout`` seconds (408 otherwise)
    and at most ``limit`` bytes (413: told by Content-Length before reading, or by aiohttp's
    ``client_max_size`` while reading a chunked body). A body aiohttp's parser refuses mid-way (an
    undecodable Content-Encoding) is a 400. Its C parser does not pass chunk framing errors that
    arrive after the head to the body's reader: those end at the timeout."""
    check_json_type(request.headers.get("Content-Type"))
    too_large = PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        metrics.http_timeouts.labels("body").inc()
        log.debug("request body from %s not received within %g s", request.remote, timeout)
        raise ClientTimeout(f"request body not received within {timeout:g} s") from None
    except web.RequestPayloadError as e:
        metrics.http_malformed.inc()
        raise BadRequest(f"malformed request body: {_short(str(e))}") from None


def _short(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


class _Digest:
    """One log line per interval for events a flood repeats (refusals, timeouts, malformed requests),
    so that 10k slow clients are not 10k lines. The first event after a quiet interval logs at once,
    with the counts since the last line; the frontend_http_* metrics count every event."""

    def __init__(self, level: int, interval: float = 60.0) -> None:
        self.level = level
        self.interval = interval
        self._counts: Counter[str] = Counter()
        self._last = float("-inf")

    def note(self, event: str) -> None:
        self._counts[event] += 1
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        log.log(self.level, "http: %s since the last report",
                ", ".join(f"{n} {what}" for what, n in self._counts.items()))
        self._counts.clear()


def _fit_open_files(max_connections: int) -> None:
    """Raise the soft open-files limit so max_connections sockets (plus the process's others) fit:
    past it, accept() fails with EMFILE long before the limit and its 503 are reached."""
    need = max_connections + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("raised the open-files limit from %d to %d for frontend.max_connections = %d",
                 soft, target, max_connections)
    if target < need:
        log.warning("open-files limit %d (hard) is below frontend.max_connections = %d plus 1024: "
                    "connections past it fail at accept() instead of getting a 503", hard, max_connections)


class GuardedServer(web.Server):
    """The low-level server of ``GuardedSite``: counts connections, and marks where each request's
    handler starts and ends (the phases' edges) around the application's own handler."""

    def __init__(self, handler: Handler, *, request_factory: RequestFactory, config: FrontendConfig,
                 metrics: FrontendMetrics, **kwargs: Any) -> None:
        super().__init__(self._handle, request_factory=self._make_request, **kwargs)
        self.config = config
        self.metrics = metrics
        self._inner_handler = handler
        self._inner_factory = request_factory
        # aiohttp's keep-alive timer is only a backstop here (see the module docstring)
        backstop = 2 * max(config.header_timeout, config.keepalive_timeout)
        self._conn_kwargs = {k: v for k, v in kwargs.items() if k != "handler_cancellation"}
        self._conn_kwargs.update(keepalive_timeout=backstop, lingering_time=LINGER_S)
        self.admitted = 0
        self.idle: dict[GuardedConnection, None] = {}  # insertion order: oldest idle first
        self.refusals = _Digest(logging.WARNING)
        self.events = _Digest(logging.INFO)

    def __call__(self) -> GuardedConnection:
        # aiohttp has no public way to choose a server's connection class (or to hook a connection's
        # opening, bytes or end): overriding the protocol factory is the one seam, pinned by the tests
        return GuardedConnection(self, loop=asyncio.get_running_loop(), **self._conn_kwargs)

    # --- the connection slots ------------------------------------------------------------------------
    def admit(self) -> bool:
        if self.admitted >= self.config.max_connections and self.idle:
            next(iter(self.idle)).evict()
        if self.admitted >= self.config.max_connections:
            self.metrics.http_refused.inc()
            self.refusals.note(f"connections refused (max_connections = {self.config.max_connections})")
            return False
        self.admitted += 1
        self.metrics.http_connections.set(self.admitted)
        return True

    def release(self) -> None:
        self.admitted -= 1
        self.metrics.http_connections.set(self.admitted)

    # --- around each request -------------------------------------------------------------------------
    def _make_request(self, message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        if isinstance(protocol, GuardedConnection):
            protocol.head_received()
        return self._inner_factory(message, payload, protocol, writer, task)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        conn = request.protocol
        try:
            try:
                resp = await self._inner_handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                # raised outside the app's middlewares, e.g. the 417 of an unknown Expect header
                err = ActorError(e.text or e.reason or "error", e.status)
                err.kind = "invalid_request_error"
                resp = json_error(err)
            body = request.content
            if body.exception() is not None:
                # the parser refused the body mid-way: the connection's framing is lost. Marked
                # finished, or aiohttp's lingering would read it again and log the parser's error as
                # "Unhandled exception" (once per such request: a log flood to order)
                resp.force_close()
                body.feed_eof()
            elif not body.is_eof():
                resp.force_close()  # the rest of the body will not be read: no next request
            return resp
        finally:
            if isinstance(conn, GuardedConnection):
                conn.handler_done()


class GuardedConnection(web.RequestHandler):
    """One HTTP connection with the guard's phases and timers (see the module docstring)."""

    __slots__ = ("_guard", "_phase", "_timer", "_served", "_slot", "_transport")

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._phase = Phase.HEAD
        self._timer: asyncio.TimerHandle | None = None
        self._served = False  # aiohttp runs this connection (a refused one it never sees)
        self._slot = False  # counted against max_connections
        self._transport: asyncio.Transport | None = None

    # --- asyncio.Protocol ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self._transport = cast(asyncio.Transport, transport)
        if not self._guard.admit():
            # aiohttp never sees this connection: no read loop, no parser run
            self._answer(Overloaded(f"too many connections (max_connections = "
                                    f"{self._guard.config.max_connections}); retry shortly"))
            return
        self._served = self._slot = True
        super().connection_made(transport)
        self._enter(Phase.HEAD, self._guard.config.header_timeout, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._phase in (Phase.CLOSING, Phase.CLOSED):
            return  # answered: what the client still sends is dropped
        if self._phase is Phase.IDLE and data:
            self._enter(Phase.HEAD, self._guard.config.header_timeout, self._head_timed_out)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._enter(Phase.CLOSED)
        self._release()
        if self._served:
            self._served = False
            super().connection_lost(exc)

    # --- phase edges (GuardedServer) -----------------------------------------------------------------
    def head_received(self) -> None:
        if self._phase in (Phase.HEAD, Phase.IDLE):
            self._enter(Phase.HANDLER)

    def handler_done(self) -> None:
        if self._phase is Phase.HANDLER:
            self._enter(Phase.IDLE, self._guard.config.keepalive_timeout, self._idle_timed_out)

    def evict(self) -> None:
        """Close this idle connection now to make room for a new one (at max_connections)."""
        self._guard.metrics.http_idle_evicted.inc()
        log.debug("closing idle connection from %s to admit a new one", self.peername)
        self._release()  # now, not once the close completes: the new connection takes this slot
        self._close_now()

    def _release(self) -> None:
        if self._slot:
            self._slot = False
            self._guard.release()

    # --- aiohttp's answer to what its parser refused (and to handler errors nothing else caught) ---
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if self._phase not in (Phase.CLOSING, Phase.CLOSED):
            self._enter(Phase.HANDLER)  # no timer while this answer is written; aiohttp then closes
        if isinstance(exc, HttpProcessingError):
            # malformed HTTP is the client's fault: never a 5xx. Logged at debug (it is what port
            # scanners and TLS-on-plain-HTTP clients send) and summarised by the digest.
            g = self._guard
            g.metrics.http_malformed.inc()
            g.events.note("malformed requests")
            log.debug("malformed HTTP request from %s: %s", request.remote, exc)
            err: ActorError = BadRequest(f"malformed HTTP request: {_short(exc.message)}",
                                         status if 400 <= status < 500 else 400)
        else:
            if status >= 500:
                log.error("error handling request from %s", request.remote, exc_info=exc)
            err = ActorError(message or f"{HTTPStatus(status).phrase}", status)
            err.kind = "timeout" if status == 504 else "internal_error" if status >= 500 else "invalid_request_error"
        if request.writer.output_size > 0:
            # aiohttp's contract: a response already started cannot be replaced
            raise ConnectionError("response already started; cannot send the error response")
        resp = json_error(err)
        resp.force_close()
        return resp

    # --- timers ------------------------------------------------------------------------------------------
    def _enter(self, phase: Phase, timeout: float | None = None,
               on_expiry: Callable[[], None] | None = None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._phase is Phase.IDLE:
            self._guard.idle.pop(self, None)
        self._phase = phase
        if phase is Phase.IDLE:
            self._guard.idle[self] = None
        if timeout is not None and on_expiry is not None:
            self._timer = asyncio.get_running_loop().call_later(timeout, on_expiry)

    def _head_timed_out(self) -> None:
        g = self._guard
        g.metrics.http_timeouts.labels("header").inc()
        g.events.note("header timeouts")
        log.debug("request headers from %s not received within %g s", self.peername, g.config.header_timeout)
        self._answer(ClientTimeout(f"request headers not received within {g.config.header_timeout:g} s"))

    def _idle_timed_out(self) -> None:
        self._guard.metrics.http_timeouts.labels("keepalive").inc()
        log.debug("closing keep-alive connection from %s idle for %g s", self.peername,
                  self._guard.config.keepalive_timeout)
        self._close_now()

    def _answer(self, err: ActorError) -> None:
        """Write a closing error response, stop writing, and close for good after LINGER_S."""
        self._enter(Phase.CLOSING, LINGER_S, self._abort)
        tr = self._transport
        if tr is None or tr.is_closing():
            return
        tr.write(raw_response(err))
        if tr.can_write_eof():
            tr.write_eof()

    def _abort(self) -> None:
        # the answer had LINGER_S to leave; a client that does not read it does not get to hold the slot
        if self._transport is not None:
            self._transport.abort()

    def _close_now(self) -> None:
        self._enter(Phase.CLOSING, LINGER_S, self._abort)
        self.force_close()


class GuardedSite:
    """A ``web.Application`` served on host:port through a ``GuardedServer``.

    The app still goes through ``web.AppRunner`` (startup, freeze, cleanup); its plain server only
    lends the app's handler and request factory, through their public attributes."""

    def __init__(self, app: web.Application, config: FrontendConfig, metrics: FrontendMetrics) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics
        self.server: GuardedServer | None = None
        self._app_runner: web.AppRunner | None = None
        self._runner: web.ServerRunner | None = None
        self._handed: HandedConnections | None = None

    async def start(self, host: str, port: int, *, backlog: int = 1024,
                    link: socket.socket | None = None) -> int:
        """Listen; returns the bound port (``port`` 0: a free one). ``link``: serve the connections
        the root process hands over on this socket instead (several frontend processes:
        ``actors.frontend.handoff``); returns ``port`` then."""
        _fit_open_files(self.config.max_connections)
        self._app_runner = web.AppRunner(self.app, access_log=None)
        await self._app_runner.setup()
        plain = self._app_runner.server
        assert plain is not None
        self.server = GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                                    config=self.config, metrics=self.metrics,
                                    handler_cancellation=True, access_log=None)
        self._runner = web.ServerRunner(self.server)
        await self._runner.setup()
        if link is not None:
            self._handed = HandedConnections(link, self.server)
            self._handed.start()
            return port
        site = web.TCPSite(self._runner, host, port, backlog=backlog, reuse_address=True)
        await site.start()
        return site.port

    async def stop(self) -> None:
        if self._handed is not None:
            self._handed.stop()
            self._handed = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._app_runner is not None:
            await self._app_runner.cleanup()
            self._app_runner = None
