"""The registry's records and the one live view of them.

- :mod:`actors.instances.contract`: what the ``<ns>-instances`` and ``<ns>-models`` buckets hold
  (written by every actor, read by frontends, the router feed and, later, a planner)
- :mod:`actors.instances.watch`: a bucket kept current in process by one watch loop with one retry
  policy, fanned out to every consumer (the frontend's worker set, the KV router feed)

Layer 3, beside ``actors.base``: it imports only config, bus and supervisors.
"""
