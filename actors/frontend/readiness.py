"""Deployment readiness, as the frontend's ``/health`` reports it (logic only, no NATS or HTTP).

Ready means serving: every pool of the topology has at least its minimum of ready workers (live,
confirmed on the bus, awake), so a request sent now is served. Before that the deployment is
``starting``; once it has been ready it stays ready until a pool the model needs loses all its
workers (``unhealthy``): a single replica restarting in a pool of several does not take the
deployment out of a load balancer, an empty pool does.

A disaggregated model needs its prefill pools too, unless the topology allows decode-only
fallback (``model.allow_decode_only``): then prefill pools are reported but not required, and the
body says ``decode_fallback: true``.

A pool's replicas are the ones its supervisor runs now (its ``children`` view): the topology's
``replicas`` is the start, and the planner (or an operator's ``spawn``/``stop``) moves it. Until a
view has been read, the topology's count is expected. The minimum a pool needs before the first
ready is the topology's count, or the count its supervisor runs when that is smaller (a frontend
restarted after the planner shrank the pool).

Once ready, what must stay is every *role* the model needs, not every pool: two decode pools on
two hosts are one capacity, and a host that dies takes its pools with it while the other host's
workers still serve every request (and receive the migrated ones). The body still shows the empty
pool, with what its replicas are doing.

For each missing replica the body says what it is doing, from the supervisors' children views
(``starting``/``loading``/``restarting``/``stopped``) and the registry (``sleeping``,
``registering``: the process runs but its engine is not registered yet).

Cold is a state, not a failure: when the model cannot be served because every pool it lacks is
asleep (all its replicas' records say "sleeping") or at zero replicas (its root's view has no
child of it: idle stop, or a planner at ``min_replicas = 0``), or a wake asked for by this
frontend is under way, the status is ``cold`` and the answer 200: a request sent now is held and
served once a replica is back (``actors.frontend.cold``). Only a wake that failed makes it
``unhealthy`` (503, with ``wake_error``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.instances.contract import InstanceRecord
from config.workers import worker_child_id

from .discovery import WorkerSet


@dataclass(frozen=True)
class PoolExpectation:
    name: str
    role: str  # agg | prefill | decode
    replicas: int
    host: str = "local"
    idle_stop: bool = False  # its replicas are removed when idle (pools.<p>.sleep.idle_stop)

    @property
    def minimum(self) -> int:
        return self.replicas


def _missing_state(child: dict[str, Any] | None, record: InstanceRecord | None) -> tuple[str, str]:
    """(state, detail) of a replica that is not serving."""
    if record is not None and record.status == "sleeping":
        return "sleeping", "asleep: the next request wakes it (or the worker's wake_up verb)"
    if child is None:
        return "unknown", "no supervisor reported this worker"
    state = child.get("state", "")
    status = str(child.get("status") or "")
    reason = str(child.get("last_exit_reason") or "")
    if state == "starting":
        return ("loading" if "load" in status or "engine" in status else "starting"), status or "process starting"
    if state == "restarting":
        if reason:
            return "restarting", f"last exit: {reason}"
        if not child.get("restarts") and child.get("started_at") is None:
            # never started: a supervisor holds each child due until the ones before it are up (a
            # root starts its workers once its frontend serves), and that is not a restart
            return "starting", "waiting to start (after the children before it)"
        return "restarting", "waiting out its backoff"
    if state == "stopped":
        return "stopped", reason or "stopped"
    if state == "running":
        if record is not None:
            return "registering", f"registered as {record.status}; not confirmed on the bus yet"
        return "registering", status or "process up; engine not registered yet"
    return state or "unknown", status or reason


@dataclass(frozen=True)
class WakeState:
    """What this frontend knows of a wake of its model (``cold.ColdGate``)."""

    waking: bool = False  # requests are held and a wake was asked for
    failure: str | None = None  # the last wake failed (answered at once for a while)


class Readiness:
    def __init__(self, model: str | None, pools: list[PoolExpectation], *, decode_fallback: bool,
                 wake: Callable[[str], WakeState] | None = None) -> None:
        self.model = model
        self.pools = pools
        disagg = any(p.role == "decode" for p in pools)
        self.decode_fallback = decode_fallback and disagg
        self.was_ready = False
        self.wake = wake

    def required(self, pool: PoolExpectation) -> bool:
        return not (pool.role == "prefill" and self.decode_fallback)

    @staticmethod
    def replicas(p: PoolExpectation, children: dict[str, dict[str, Any]]) -> list[int]:
        """The replica indices of ``p`` its supervisor runs (removed ones are gone from its view),
        or the topology's ``range(replicas)`` while no view of the pool has been read."""
        mine = sorted(int(c["meta"]["replica"]) for c in children.values()
                      if (c.get("meta") or {}).get("pool") == p.name and str(c["meta"].get("replica", "")).isdigit())
        return mine or list(range(p.replicas))

    def _missing(self, p: PoolExpectation, live: set[str], records: list[InstanceRecord],
                 children: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The replicas of ``p`` that are not serving, with what each is doing."""
        mine = [r for r in records if r.pool == p.name]
        views = {i: children.get(worker_child_id(p.name, i)) for i in self.replicas(p, children)}
        missing: list[dict[str, Any]] = []
        if not any(views.values()):
            # no supervisor view (e.g. another host's supervisor did not answer): count only
            idle = [r for r in mine if r.instance not in live]
            for i in range(max(0, len(views) - len(live))):
                rec = idle[i] if i < len(idle) else None
                state, detail = _missing_state(None, rec)
                missing.append({"replica": None, "state": state, "detail": detail})
            return missing
        for i, child in views.items():
            pid = child.get("pid") if child else None
            rec = next((r for r in mine if pid is not None and r.pid == pid), None)
            if rec is not None and rec.instance in live:
                continue
            state, detail = _missing_state(child, rec)
            missing.append({"replica": i, "child": worker_child_id(p.name, i),
                            "state": state, "detail": detail})
        return missing

    @staticmethod
    def cold_pool(p: PoolExpectation, records: list[InstanceRecord], children: dict[str, dict[str, Any]],
                  views_complete: bool, served: bool = True) -> str | None:
        """Why pool ``p`` (no ready worker) is cold: "sleep" (every replica it has is asleep),
        "zero" (its root runs no replica of it), or None (starting, failing, or not known).
        ``served``: the deployment has been ready (before, replicas without a record are a start)."""
        mine = [r for r in records if r.pool == p.name]
        every = [c for c in children.values() if (c.get("meta") or {}).get("pool") == p.name]
        kids = [c for c in every if c.get("state") != "stopped"]
        if mine and all(r.status == "sleeping" for r in mine) and len(kids) <= len(mine):
            return "sleep"
        if len(kids) < len(every):
            # a replica stopped and kept (an operator's stop, a finished checkpoint snapshot) was
            # stopped on purpose: nothing a request should start again
            return None
        if views_complete and not mine and (not kids or (p.idle_stop and served and all(
                c.get("state") in ("running", "starting") for c in kids))):
            # no replica; or (idle stop) only replicas whose process runs without a record: one
            # being removed (how a pool reaches zero) or one a wake started (how it comes back,
            # maybe at another frontend's demand). A replica restarting after a crash is neither
            return "zero"
        return None

    def evaluate(self, workers: WorkerSet, children: dict[str, dict[str, Any]] | None = None,
                 views_complete: bool = False) -> tuple[bool, dict[str, Any]]:
        """(ready, /health body). ``children`` maps child id → supervisor child view (any host);
        ``views_complete``: every root answered the last time they were asked (a pool with no child
        is then really at zero replicas)."""
        children = children or {}
        ready_list = workers.ready_instances()
        records = workers.records()
        pools: dict[str, Any] = {}
        full = True  # every pool at its minimum
        serving: dict[str, int] = {}  # ready workers per role the model needs
        for p in self.pools:
            live = [w for w in ready_list if w.pool == p.name and (self.model is None or w.model == self.model)]
            missing = self._missing(p, {w.instance for w in live}, records, children)
            expected = len(self.replicas(p, children))
            # the topology's count, or fewer when the planner (or an operator's stop with "remove")
            # shrank the pool: a frontend (re)started after a shrink waits for the replicas that run,
            # not for ones that were removed. A pool grown beyond the topology does not raise it: the
            # start is ready at the topology's count, as a first start is
            minimum = min(p.minimum, expected)
            pools[p.name] = {"role": p.role, "ready": len(live), "expected": expected,
                             "minimum": minimum, "required": self.required(p), "missing": missing}
            if self.required(p):
                full = full and len(live) >= minimum
                serving[p.role] = serving.get(p.role, 0) + len(live)
        none_empty = all(serving.values())  # every needed role still has a ready worker
        if self.pools:
            ready = (full or (self.was_ready and none_empty)) and (
                self.model is None or self.model in workers.models)
        else:  # no topology to compare with (a frontend built on its own): any servable model
            ready = bool(workers.models)
        status = "healthy" if ready else ("unhealthy" if self.was_ready else "starting")
        cold: dict[str, Any] | None = None
        wake_error: str | None = None
        if not ready and self.model is not None and self.model not in workers.models:
            cold, wake_error = self._cold(workers, records, children, views_complete, pools)
            if wake_error is not None:
                status = "unhealthy"
            elif cold is not None:
                status, ready = "cold", True
        self.was_ready = self.was_ready or ready
        body: dict[str, Any] = {
            "status": status,
            "models": sorted(workers.models),
            "pools": pools,
            "instances": [{"instance": w.instance, "model": w.model, "pool": w.pool, "role": w.role,
                           "subject": w.subject} for w in ready_list],
        }
        if self.decode_fallback:
            body["decode_fallback"] = True
        if cold is not None:
            body["cold"] = cold
        if wake_error is not None:
            body["wake_error"] = wake_error
        return ready, body

    def _cold(self, workers: WorkerSet, records: list[InstanceRecord], children: dict[str, dict[str, Any]],
              views_complete: bool, pools: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        """(the body's ``cold`` section or None, the failure of the last wake or None)."""
        assert self.model is not None
        wake = self.wake(self.model) if self.wake is not None else WakeState()
        if wake.failure is not None:
            return None, wake.failure
        live = {w.pool for w in workers.ready_instances()}
        why: dict[str, str] = {}
        for p in self.pools:
            if not self.required(p) or p.name in live:
                continue
            reason = self.cold_pool(p, records, children, views_complete, self.was_ready or wake.waking)
            if reason is None and not wake.waking:
                return None, None  # a pool is missing for another reason: starting or failing
            why[p.name] = reason or "waking"
            pools[p.name]["cold"] = why[p.name]
            if reason == "zero":
                pools[p.name]["expected"] = 0
                pools[p.name]["missing"] = [{"replica": None, "state": "zero", "detail": (
                    "no replica runs (idle stop, or a planner at min_replicas 0): the next request starts one")}]
        if not why:
            return None, None
        return {"model": self.model, "pools": why, "waking": wake.waking}, None
