"""Per-worker-process status server (aiohttp): /health, /live, /metrics.

/health answers 503 until the worker is ready (engine up, health monitor satisfied), then 200 with
``{status, endpoints, uptime}``; /live answers 200 while the event loop turns (a hung engine does not
make the process dead — that is the health monitor's job); /metrics is Prometheus text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from config.topology import FrontendConfig, PoolConfig

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]
MetricsRender = Callable[[], tuple[bytes, str]]

LOOPBACK = "127.0.0.1"
_WILDCARDS = {"", "0.0.0.0", "::", "*"}


def status_bind_host(pool: PoolConfig, frontend: FrontendConfig) -> str:
    """Where a worker's status server listens: ``pool.status_host`` when the topology sets it, else
    the frontend's host when the pool shares the frontend's machine. A frontend opened to every
    interface does not open the workers too (they show engine internals and have no auth): that
    takes an explicit ``status_host``. A pool on another machine cannot bind the frontend's address."""
    if pool.status_host:
        return pool.status_host
    if pool.host != frontend.host:
        return LOOPBACK
    host = frontend.http.rpartition(":")[0].strip("[]")
    return LOOPBACK if host in _WILDCARDS else host


class StatusServer:
    def __init__(self, port: int, ready: ReadyCheck, metrics: MetricsRender, *,
                 host: str = LOOPBACK, endpoints: Callable[[], list[str]] | None = None) -> None:
        self.port = port
        self.host = host
        self._ready = ready
        self._metrics = metrics
        self._endpoints = endpoints or (lambda: [])
        self._runner: web.AppRunner | None = None
        self.started = time.monotonic()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/live", self._live)
        app.router.add_get("/metrics", self._metrics_h)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site.port  # the bound one: port 0 (tests) asks the kernel for a free port
        log.info("status server on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _req: web.Request) -> web.Response:
        try:
            ok, detail = await self._ready()
        except Exception as e:  # noqa: BLE001 - a failing check means not ready, not a 500
            ok, detail = False, {"message": f"{type(e).__name__}: {e}"}
        body = {"status": "healthy" if ok else "notready", "endpoints": self._endpoints(),
                "uptime": round(time.monotonic() - self.started, 3), **detail}
        return web.json_response(body, status=200 if ok else 503)

    async def _live(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "alive", "uptime": round(time.monotonic() - self.started, 3)})

    async def _metrics_h(self, _req: web.Request) -> web.Response:
        body, ctype = self._metrics()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = ctype
        return resp
