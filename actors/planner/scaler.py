"""How the planner changes a deployment: the supervisors' own NATS verbs, nothing else.

- ``children``: what a host's root runs now. The planner counts replicas from these views on every
  decision, so a restarted planner starts from the real counts, not from what it last asked for.
- ``spawn {"pool", "replica"}``: a replica of a pool, built by the root from its topology (never a
  command). The root answers once the worker is ready, or with the start error; a spawned child
  whose first start fails is discarded by the supervisor (OTP's ``start_child``), so a broken pool
  cannot become a child restarted forever.
- ``stop {"id", "remove": true}``: the worker deregisters, keeps serving what was routed to it for
  its grace period, drains its streams, then exits; the child is removed, so it is not restarted.
"""

from __future__ import annotations

import time
from typing import Any

from nats.aio.client import Client

from actors.planner.contract import Action
from bus import rpc
from bus.errors import ActorError
from bus.subjects import Subjects
from config.workers import worker_child_id

# a spawn's reply waits for the worker's engine: this bounds it beyond the root's own ready timeout
SPAWN_TIMEOUT = {"mocker": 90.0, "vllm": 960.0}
# a stop waits for the drain (the pool's drain timeouts) and the process's exit
STOP_TIMEOUT = 120.0
CHILDREN_TIMEOUT = 2.0


class Scaler:
    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects

    async def children(self, host: str) -> list[dict[str, Any]]:
        """The root of ``host``'s children views (raises a transport error if it does not answer)."""
        reply = await rpc.request(self.nc, self.subjects.supervisor(host, "children"), {},
                                  timeout=CHILDREN_TIMEOUT)
        return list(reply.get("children", []))

    async def spawn(self, host: str, pool: str, replica: int, engine: str) -> Action:
        child = worker_child_id(pool, replica)
        t0 = time.monotonic()
        try:
            await rpc.request(self.nc, self.subjects.supervisor(host, "spawn"),
                              {"pool": pool, "replica": replica, "wait": True},
                              timeout=SPAWN_TIMEOUT.get(engine, SPAWN_TIMEOUT["vllm"]))
        except ActorError as e:
            return Action(kind="spawn", pool=pool, child=child, host=host, outcome="failed",
                          error=str(e)[:500], seconds=round(time.monotonic() - t0, 3))
        return Action(kind="spawn", pool=pool, child=child, host=host, outcome="ok",
                      seconds=round(time.monotonic() - t0, 3))

    async def stop(self, host: str, pool: str, child: str) -> Action:
        t0 = time.monotonic()
        try:
            await rpc.request(self.nc, self.subjects.supervisor(host, "stop"), {"id": child, "remove": True},
                              timeout=STOP_TIMEOUT)
        except ActorError as e:
            return Action(kind="stop", pool=pool, child=child, host=host, outcome="failed",
                          error=str(e)[:500], seconds=round(time.monotonic() - t0, 3))
        return Action(kind="stop", pool=pool, child=child, host=host, outcome="ok",
                      seconds=round(time.monotonic() - t0, 3))
