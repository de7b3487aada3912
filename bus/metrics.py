"""Bus health of this process on Prometheus, computed when scraped (nothing is counted per message:
nats-py keeps the counts in ``Client.stats`` anyway).

Every connection ``bus.connection.connect`` opens is tracked (weakly: a closed and dropped client
leaves the scrape). A process has one connection in a deployment; a test process has several, so
the series are sums over the open ones, with ``vllm_actors_bus_connections`` saying how many.
``REGISTRY`` is what each /metrics of the process renders beside its own series.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from nats.aio.client import Client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)

_clients: weakref.WeakSet[Client] = weakref.WeakSet()

# nc.stats key -> (series name without _total, help)
_COUNTERS = (
    ("reconnects", "vllm_actors_bus_reconnects", "Reconnects to the bus after an outage"),
    ("in_msgs", "vllm_actors_bus_received_messages", "Messages received from the bus"),
    ("out_msgs", "vllm_actors_bus_sent_messages", "Messages published to the bus"),
    ("in_bytes", "vllm_actors_bus_received_bytes", "Payload bytes received from the bus"),
    ("out_bytes", "vllm_actors_bus_sent_bytes", "Payload bytes published to the bus"),
    ("errors_received", "vllm_actors_bus_errors", "Errors the server sent (-ERR)"),
)


def track(nc: Client) -> None:
    _clients.add(nc)


class _BusCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        open_ = [nc for nc in list(_clients) if not nc.is_closed]
        yield GaugeMetricFamily("vllm_actors_bus_connections", "Open bus connections of this process",
                                value=len(open_))
        yield GaugeMetricFamily("vllm_actors_bus_connected", "Open bus connections that are connected now "
                                "(1 in a deployment's process; 0 while the bus is out)",
                                value=sum(nc.is_connected for nc in open_))
        for key, name, text in _COUNTERS:
            # closed clients drop out, so a sum could fall; a process closes its one connection only
            # when it ends, which a scrape sees as the target going down, not as a counter reset
            yield CounterMetricFamily(name, text, value=sum(int(nc.stats.get(key, 0)) for nc in open_))

    def describe(self) -> Iterator[Metric]:
        return iter(())  # computed at scrape time: nothing to check for clashes up front


REGISTRY.register(_BusCollector())
