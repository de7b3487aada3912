"""KV-aware routing (pure logic; the NATS transport lives elsewhere).

- :mod:`actors.router.index`: exact KV index fed by KV events (gap detection, dump/range recovery)
- :mod:`actors.router.approx`: index fed by the router's own decisions (TTL): the approx-mode index, and
  the kv-mode overlay of predicted blocks
- :mod:`actors.router.load`: active prefill/decode load per worker
- :mod:`actors.router.cost`: cost function and selection
- :mod:`actors.router.kv_router`: the facade the frontend calls per request
- :mod:`actors.router.metrics`: Prometheus metrics on an explicit registry
"""

from actors.router.approx import ApproxIndex
from actors.router.cost import CostSelector, RouterConfig, RoutingDecision, WorkerCost
from actors.router.index import Gap, KvIndex
from actors.router.kv_router import KvRouter
from actors.router.load import LoadTracker
from actors.router.metrics import RouterMetrics

__all__ = ["ApproxIndex", "CostSelector", "Gap", "KvIndex", "KvRouter", "LoadTracker", "RouterConfig",
           "RouterMetrics", "RoutingDecision", "WorkerCost"]
