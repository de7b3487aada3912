"""One NATS connection per OS process: URL, auth, TLS, reconnect forever with jittered backoff.

Why a custom reconnect handler: nats-py's default waits a fixed ``reconnect_time_wait`` between
attempts, so every process of a host that lost its server reconnects in lock step (thundering herd
when the server comes back). The handler below picks the least-tried server and sleeps an
exponentially growing, jittered delay instead.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import ssl
import time
import weakref
from typing import Any

import nats
from nats.aio.client import Client

from bus import metrics
from bus.backoff import Backoff
from config.secrets import password, token
from config.topology import BusConfig, BusTLS

log = logging.getLogger(__name__)

RECONNECT_BASE = 0.25  # first retry delay (s)
RECONNECT_MAX = 5.0  # cap of the exponential backoff (s)
RECONNECT_JITTER = 0.5  # +-50 % of the delay
RECONNECT = Backoff(initial=RECONNECT_BASE, max=RECONNECT_MAX, multiplier=2.0, jitter=RECONNECT_JITTER)
# After a bus outage every process reconnects on its own backoff, the last at most RECONNECT_MAX
# (Backoff caps the jittered delay) after the server is back, plus its connect. Until then "no
# responders" from another process says it has not reconnected yet, not that it is dead. The window
# is that bound with room to spare: a full jitter above the cap, and half a second for the connect.
SETTLE_S = RECONNECT_MAX * (1 + RECONNECT_JITTER) + 0.5

# when each connection last came back from an outage, and nats-py's reconnect count then (weak keys:
# this never keeps a client alive)
_reconnected_at: weakref.WeakKeyDictionary[Client, tuple[int, float]] = weakref.WeakKeyDictionary()


def _reconnect_handler(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
    # Least-tried server first; its retry count drives the backoff.
    server = min(servers, key=lambda s: s.reconnects)
    return server, RECONNECT.delay(server.reconnects)


def ssl_context(tls: BusTLS) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    if tls.cert_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


def connect_options(cfg: BusConfig | str, name: str, inbox_prefix: str | None = None) -> dict[str, Any]:
    """The keyword arguments for ``nats.connect`` (split out so it is testable without a server).
    ``inbox_prefix``: where replies to this process arrive (per namespace, so per-role permissions
    can let a user read its own deployment's replies and no other)."""
    if isinstance(cfg, str):
        cfg = BusConfig(url=cfg)
    url = cfg.url or f"nats://127.0.0.1:{cfg.port}"
    opts: dict[str, Any] = {
        "servers": [u.strip() for u in url.split(",") if u.strip()],
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,  # forever: a supervisor, not the client, decides to give up
        "reconnect_time_wait": RECONNECT_BASE,
        "reconnect_to_server_handler": _reconnect_handler,
        "connect_timeout": 5,
        "ping_interval": 10,
        "max_outstanding_pings": 3,
    }
    if inbox_prefix:
        opts["inbox_prefix"] = inbox_prefix
    a = cfg.auth
    tok = token(a)
    if tok:
        opts["token"] = tok
    if a.user:
        opts["user"] = a.user
        opts["password"] = password(a) or ""
    if a.nkey_seed:
        opts["nkeys_seed"] = os.path.expanduser(a.nkey_seed)
    if a.creds:
        opts["user_credentials"] = os.path.expanduser(a.creds)
    if cfg.tls is not None:
        opts["tls"] = ssl_context(cfg.tls)
        if cfg.tls.hostname:
            opts["tls_hostname"] = cfg.tls.hostname
    return opts


async def connect(cfg: BusConfig | str, name: str, *, initial_attempts: int = 3,
                  inbox_prefix: str | None = None) -> Client:
    """Connect and log status changes. The *initial* connect tries each server ``initial_attempts``
    times and then raises (a supervisor restarts us with its own backoff; nats-py would otherwise
    loop forever on a wrong URL or bad credentials); once connected, outages are retried forever."""
    opts = connect_options(cfg, name, inbox_prefix)
    servers = opts["servers"]
    opts["max_reconnect_attempts"] = max(1, initial_attempts)

    async def on_disconnected() -> None:
        if nc.is_closed or nc.is_draining:  # our own close(): not an outage
            log.debug("nats %s: disconnected (closing)", name)
        else:
            log.warning("nats %s: disconnected from %s; reconnecting", name, servers)

    async def on_reconnected() -> None:
        _reconnected_at[nc] = (nc.stats["reconnects"], time.monotonic())
        log.info("nats %s: reconnected to %s", name, nc.connected_url.netloc if nc.connected_url else "?")

    async def on_closed() -> None:
        log.info("nats %s: connection closed", name)

    errors: collections.deque[Exception] = collections.deque(maxlen=1)  # the last, for the first connect's message

    async def on_error(e: Exception) -> None:
        errors.append(e)
        log.warning("nats %s: %s: %s", name, type(e).__name__, e)

    # nats-py's attempt bound does not cover every failure: a TLS handshake the client refuses (no
    # CA for the server's certificate) is retried forever. Bound the whole first connect.
    bound = opts["connect_timeout"] * opts["max_reconnect_attempts"] * len(servers) + 5.0
    try:
        nc: Client = await asyncio.wait_for(nats.connect(
            **opts,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
            error_cb=on_error,
        ), bound)
    except TimeoutError:
        last = f": {type(errors[-1]).__name__}: {errors[-1]}" if errors else ""
        raise ConnectionError(f"nats {name}: no connection to {', '.join(servers)} within {bound:g}s"
                              f"{last}") from None
    nc.options["max_reconnect_attempts"] = -1  # read on every reconnect: from now on, forever
    metrics.track(nc)  # bus health on this process's /metrics
    log.info("nats %s: connected to %s", name, nc.connected_url.netloc if nc.connected_url else servers)
    return nc


def settling(nc: Client, window: float = SETTLE_S) -> bool:
    """True while ``nc`` is cut off from the bus, or for ``window`` seconds after it came back: the
    other processes may still be reconnecting, so their silence is not a verdict on them yet."""
    if not nc.is_connected:
        return True
    seen = _reconnected_at.get(nc)
    if nc.stats["reconnects"] > (seen[0] if seen else 0):
        # connected again, but nats-py calls the reconnected callback only after replaying the
        # subscriptions and a flush: until then this is the first moment of the window
        return True
    return seen is not None and time.monotonic() - seen[1] < window


async def wait_connected(nc: Client, timeout: float) -> bool:
    """Whether ``nc`` is connected, waiting up to ``timeout`` seconds for a reconnect in progress."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not nc.is_connected:
        if nc.is_closed or loop.time() >= end:
            return False
        await asyncio.sleep(0.05)
    return True


async def until_closed(nc: Client, poll: float = 1.0) -> None:
    """Return once ``nc`` is closed for good. nats-py reconnects forever, but it closes a connection
    after some server errors (a message over max_payload, an authorization change); a process whose
    only connection is closed is off the bus for good and should exit so its supervisor restarts it."""
    while not nc.is_closed:
        await asyncio.sleep(poll)


async def flush_in_order(nc: Client, timeout: float = 10.0) -> None:
    """Return once the server has processed everything this connection wrote before the call: a
    subscription just made is live, so what another connection publishes from now on reaches it.

    ``Client.flush()`` alone does not promise that in nats-py 2.16: it writes its PING straight to
    the socket, while the SUB of a ``subscribe()`` just made can still wait in the queue of the
    client's flusher task. The PONG then comes back before the server has the SUB, and a message
    another connection publishes meanwhile is not delivered: 41-66 of 1,000 rounds of subscribe,
    flush, publish from a second connection missed it, on an idle box. So first wait until the
    flusher has written what is queued (``_flush_pending(force_flush=True)`` resolves then; at once
    when not connected), then PING. Called directly, not guarded: if nats-py renames it, every
    start fails loudly rather than the race coming back unseen."""
    await asyncio.wait_for(nc._flush_pending(force_flush=True), timeout)
    await nc.flush(timeout=timeout)  # type: ignore[arg-type]  # annotated int; a float works
