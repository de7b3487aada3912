"""The root's /metrics (``[metrics] root_port``): what a host's root process knows that no other
/metrics shows. The root serves no HTTP otherwise; this listener is opt-in, on loopback unless
``metrics.root_host`` says otherwise.

It renders the process-level registries (``supervisors.metrics``: the root's restarts and children
by state; ``bus.metrics``: its bus connection), the planner's series when the planner runs in this
root (``extra``), and prometheus_client's default registry (the process's CPU and memory). When the
frontend runs in the root (``frontend.processes`` = 1), its /metrics shows the same process-level
series: the dashboard's queries take ``max`` over targets where that would count them twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import bus.metrics
import supervisors.metrics

log = logging.getLogger(__name__)


def render(extra: Sequence[CollectorRegistry] = ()) -> bytes:
    registries = (supervisors.metrics.REGISTRY, bus.metrics.REGISTRY, *extra, REGISTRY)
    return b"".join(generate_latest(r) for r in registries)


class RootMetricsServer:
    def __init__(self, host: str, port: int, extra: Sequence[CollectorRegistry] = ()) -> None:
        self.host, self.port = host, port
        self.extra = tuple(extra)
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Listen; returns the bound port (``port`` 0: the kernel's pick)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("root metrics on http://%s:%d/metrics", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=render(self.extra), headers={"Content-Type": CONTENT_TYPE_LATEST})
