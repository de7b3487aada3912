"""The in-process router the frontend calls on its hot path: hash → match → cost → book load.

Pure logic (no NATS): the transport feeds ``apply_event`` / ``apply_range`` / ``load_dump`` from
``ns.kv.events.*`` and the publishers' index endpoints, ``reconcile`` from ``ns.load.*``, and
``remove_worker`` when a registry entry expires. The frontend calls ``route`` then
``first_token`` / ``add_output_tokens`` / ``finish`` for each request.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from actors.kv import hashing
from actors.kv.contract import KvRangeReply, KvSnapshot, RouterKvEvent
from actors.router.approx import ApproxIndex
from actors.router.cost import CostSelector, RouterConfig, RoutingDecision
from actors.router.index import Gap, KvIndex
from actors.router.load import LoadTracker
from actors.router.metrics import RouterMetrics
from actors.worker.contract import LoadReport

log = logging.getLogger(__name__)

Worker = tuple[str, int]


class KvRouter:
    def __init__(self, config: RouterConfig, *, mode: Literal["kv", "approx"] = "kv",
                 approx_ttl: float = 120.0, metrics: RouterMetrics | None = None,
                 rng: random.Random | None = None, load: LoadTracker | None = None) -> None:
        self.config = config
        self.mode = mode
        self.metrics = metrics or RouterMetrics()
        self.index: KvIndex | ApproxIndex = (
            KvIndex(config.block_size, metrics=self.metrics) if mode == "kv" else ApproxIndex(approx_ttl))
        self.load = load or LoadTracker(config.block_size)
        self.selector = CostSelector(config, metrics=self.metrics, rng=rng)
        self._auto_id = 0
        self._decisions: dict[str, Any] = {}  # mode -> labelled counter child (.labels() costs more than .inc())

    # ---- hot path --------------------------------------------------------------------------------
    def route(self, tokens: Sequence[int], workers: Sequence[Worker], *, request_id: str | None = None,
              lora_name: str | None = None, salt: str | None = None,
              block_sizes: Mapping[Worker, int | None] | None = None) -> RoutingDecision:
        """Choose a worker for ``tokens`` and book the request's load there."""
        m = self.metrics
        t0 = time.perf_counter()
        seqs = hashing.sequence_hashes(tokens, self.config.block_size, lora_name, salt)
        t1 = time.perf_counter()
        overlaps = self.index.find_matches(seqs)
        t2 = time.perf_counter()
        decision = self.selector.select(workers, len(tokens), overlaps, self.load, self.index,
                                        block_sizes=block_sizes)
        t3 = time.perf_counter()
        decision.mode = self.mode
        m.hashing_seconds.observe(t1 - t0)
        m.matching_seconds.observe(t2 - t1)
        m.scheduling_seconds.observe(t3 - t2)
        dec = self._decisions.get(self.mode)
        if dec is None:
            dec = self._decisions[self.mode] = m.decisions.labels(self.mode)
        dec.inc()
        m.observe_hit(len(seqs), decision.overlap_blocks)
        if request_id is None:
            self._auto_id += 1
            request_id = f"auto-{self._auto_id}"
        self.load.add_request(request_id, decision.worker, len(tokens), decision.overlap_blocks)
        if isinstance(self.index, ApproxIndex):
            self.index.record(decision.worker, seqs)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s -> %s/%d overlap=%d/%d cost=%.2f costs=%s", request_id,
                      decision.instance, decision.dp_rank, decision.overlap_blocks,
                      decision.request_blocks, decision.cost,
                      [(c.instance, c.dp_rank, c.overlap_blocks, round(c.cost, 2)) for c in decision.costs])
        return decision

    def first_token(self, request_id: str) -> None:
        self.load.first_token(request_id)

    def add_output_tokens(self, request_id: str, n: int) -> None:
        self.load.add_output_tokens(request_id, n)

    def finish(self, request_id: str) -> None:
        self.load.finish(request_id)

    # ---- feeds -----------------------------------------------------------------------------------
    def apply_event(self, event: RouterKvEvent) -> Gap | None:
        if isinstance(self.index, KvIndex):
            return self.index.apply(event)
        return None

    def apply_range(self, reply: KvRangeReply) -> Gap | None:
        return self.index.apply_range(reply) if isinstance(self.index, KvIndex) else None

    def load_dump(self, instance: str, snapshot: KvSnapshot) -> Gap | None:
        return self.index.load_dump(instance, snapshot) if isinstance(self.index, KvIndex) else None

    def reconcile(self, report: LoadReport) -> None:
        self.load.reconcile(report)

    def remove_worker(self, instance: str) -> None:
        self.index.remove_worker(instance)
        self.load.remove_worker(instance)

    def stats(self) -> dict:
        return {"mode": self.mode, "block_size": self.config.block_size, "index": self.index.stats(),
                "load": self.load.snapshot()}
