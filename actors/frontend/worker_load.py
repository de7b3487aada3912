"""Every worker's load as this frontend sees it, on the frontend's /metrics.

Workers publish a ``LoadReport`` per DP rank on ``ns.load.<instance>``. The KV router reads them,
the round-robin router does not, so the frontend subscribes on its own whichever router runs (one
more decode of a small message per report and worker, a few per second in all). Only the latest
report per (instance, rank) is kept; the series are built at scrape time, joined with the
registry's record of the worker (pool, model): one scrape of the frontend shows every worker, also
when pools have no ``status_port``, and a worker whose record left the registry leaves the scrape
(its last report is dropped then too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors.instances.contract import InstanceRecord
from actors.worker.contract import LoadReport
from bus import codec
from bus.context import BusContext

log = logging.getLogger(__name__)

_LABELS = ["worker_id", "pool", "model", "dp_rank"]
# series name (after the frontend's prefix) -> help, and how to read it off a report
_SERIES: tuple[tuple[str, str, Callable[[LoadReport], float]], ...] = (
    ("worker_kv_usage_perc", "A worker's KV cache usage (0..1), from its load reports",
     lambda r: r.kv_usage),
    ("worker_kv_active_blocks", "A worker's KV blocks held by requests, from its load reports",
     lambda r: r.active_kv_blocks),
    ("worker_kv_total_blocks", "A worker's KV cache blocks, from its load reports",
     lambda r: r.total_kv_blocks),
    ("worker_num_requests_running", "Requests a worker's scheduler runs, from its load reports",
     lambda r: r.num_running),
    ("worker_num_requests_waiting", "Requests waiting in a worker's scheduler (its queue), from its load reports",
     lambda r: r.num_waiting),
    ("worker_prefix_cache_hit_rate", "A worker's prefix cache hit rate (cumulative), from its load reports",
     lambda r: r.prefix_hit_rate),
)


class WorkerLoad(Collector):
    """The latest reports (logic: ``on_report``), exported at scrape time (``collect``).
    ``records`` lists the workers' registry records (``WorkerSet.records``)."""

    def __init__(self, records: Callable[[], list[InstanceRecord]], prefix: str) -> None:
        self.records = records
        self.prefix = prefix
        self._latest: dict[tuple[str, int], LoadReport] = {}

    def on_report(self, report: LoadReport) -> None:
        self._latest[(report.instance, report.dp_rank)] = report

    def collect(self) -> Iterator[Metric]:
        known = {r.instance: r for r in self.records() if r.is_worker}
        for key in [k for k in self._latest if k[0] not in known]:
            del self._latest[key]  # its worker left the registry: so does its series
        families = [(GaugeMetricFamily(f"{self.prefix}_{name}", text, labels=_LABELS), read)
                    for name, text, read in _SERIES]
        for (instance, rank), report in sorted(self._latest.items()):
            rec = known[instance]
            labels = [instance, rec.pool or "", rec.model, str(rank)]
            for fam, read in families:
                fam.add_metric(labels, read(report))
        for fam, _ in families:
            yield fam

    def describe(self) -> Iterator[Metric]:
        return iter(())  # built at scrape time


class WorkerLoadFeed:
    """The subscription that feeds a ``WorkerLoad``."""

    def __init__(self, bus: BusContext, load: WorkerLoad) -> None:
        self.bus = bus
        self.load = load
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.bus.nc.subscribe(self.bus.subjects.load_all(), cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as e:  # noqa: BLE001 - a closed connection has no subscription to end
                log.debug("load feed unsubscribe: %s", e)

    async def _on_msg(self, msg: Any) -> None:
        try:
            report = codec.decode(msg.data, msg.headers, LoadReport)
        except Exception as e:  # noqa: BLE001 - anyone on the bus can publish there
            log.debug("bad load report on %s: %s", msg.subject, e)
            return
        self.load.on_report(report)
