"""KV-aware routing: the logic, its transport from NATS, and its NATS endpoints.

- :mod:`actors.router.index`: exact KV index fed by KV events (gap detection, dump/range recovery)
- :mod:`actors.router.approx`: index fed by the router's own decisions (TTL): the approx-mode index, and
  the kv-mode overlay of predicted blocks
- :mod:`actors.router.load`: active prefill/decode load per worker
- :mod:`actors.router.cost`: cost function and selection
- :mod:`actors.router.kv_router`: the facade the frontend calls per request
- :mod:`actors.router.metrics`: Prometheus metrics on an explicit registry
- :mod:`actors.router.feed`: KV events, load reports and the registry from NATS into a KvRouter
- :mod:`actors.router.service`: the router's NATS endpoints, answered from the frontend's router
"""
