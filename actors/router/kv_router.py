"""The in-process router the frontend calls on its hot path: hash → match → cost → book load.

Pure logic (no NATS): the transport feeds ``apply_event`` / ``apply_range`` / ``load_dump`` from
``ns.kv.events.*`` and the publishers' index endpoints, ``reconcile`` from ``ns.load.*``, and
``remove_worker`` when a registry entry expires. The frontend calls ``route`` then
``first_token`` / ``add_output_tokens`` / ``finish`` for each request.

Decisions are booked at once: in ``kv`` mode, the blocks of a routed request are *predicted* on the
chosen worker (an :class:`ApproxIndex` overlay with a TTL) until its KV events confirm them, a
removal or clear contradicts them, or the worker goes. Without that, a follow-up sent before the
first request's events arrive sees no overlap anywhere and lands on another worker. A worker holds
block ``i`` if the event-fed index *or* the overlay says so; its overlap is the longest such prefix.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from actors.kv import hashing
from actors.kv.contract import KvRangeReply, KvSnapshot, RouterKvEvent
from actors.router.affinity import SessionAffinity
from actors.router.approx import ApproxIndex
from actors.router.cost import CostSelector, RouterConfig, RoutingDecision
from actors.router.index import Gap, KvIndex
from actors.router.latency import LatencyModel
from actors.router.load import LoadTracker
from actors.router.metrics import RouterMetrics
from actors.worker.contract import LoadReport

log = logging.getLogger(__name__)

Worker = tuple[str, int]


class KvRouter:
    def __init__(self, config: RouterConfig, *, mode: Literal["kv", "approx"] = "kv",
                 approx_ttl: float = 120.0, metrics: RouterMetrics | None = None,
                 rng: random.Random | None = None, load: LoadTracker | None = None,
                 clock: Callable[[], float] = time.monotonic, session_ttl: float = 300.0) -> None:
        self.config = config
        self.mode = mode
        self.metrics = metrics or RouterMetrics()
        self.index: KvIndex | ApproxIndex = (
            KvIndex(config.block_size, metrics=self.metrics) if mode == "kv"
            else ApproxIndex(approx_ttl, clock=clock))
        # kv mode: decisions not yet confirmed by events (approx mode's index already is that)
        self.predictions: ApproxIndex | None = ApproxIndex(approx_ttl, clock=clock) if mode == "kv" else None
        self.load = load or LoadTracker(config.block_size)
        self.latency = LatencyModel()
        self.selector = CostSelector(config, metrics=self.metrics, rng=rng, latency=self.latency)
        self.sessions = SessionAffinity(session_ttl, clock=clock)
        self._clock = clock
        self._auto_id = 0
        self._decisions: dict[str, Any] = {}  # mode -> labelled counter child (.labels() costs more than .inc())
        # other frontends' views (actors.router.bookings): told of each booking, prefill and finish
        self.on_booked: Callable[[str, Worker, int, int, list[int], str | None], None] | None = None
        self.on_first: Callable[[str], None] | None = None
        self.on_finished: Callable[[str], None] | None = None

    # ---- hot path --------------------------------------------------------------------------------
    def route(self, tokens: Sequence[int], workers: Sequence[Worker], *, request_id: str | None = None,
              lora_name: str | None = None, salt: str | None = None,
              block_sizes: Mapping[Worker, int | None] | None = None, book: bool = True,
              mm: Sequence[hashing.MmSpan] | None = None, session: str | None = None) -> RoutingDecision:
        """Choose a worker for ``tokens``; with ``book``, book the request's load and blocks there.
        ``mm``: the prompt's images (placeholder ranges in ``tokens``), hashed into their blocks.
        ``session``: the client's session id (soft affinity, ``actors.router.affinity``)."""
        m = self.metrics
        t0 = time.perf_counter()
        seqs = hashing.sequence_hashes(tokens, self.config.block_size, lora_name, salt, mm)
        t1 = time.perf_counter()
        real = self.index.find_matches(seqs)
        overlaps = self._with_predictions(seqs, real)
        t2 = time.perf_counter()
        decision = self.selector.select(workers, len(tokens), overlaps, self.load, self,
                                        block_sizes=block_sizes)
        if session and self.sessions.ttl > 0:
            decision = self._affinity(session, decision, book)
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
        chosen = next((c for c in decision.costs if (c.instance, c.dp_rank) == decision.worker), None)
        predicted = chosen.ttft_ms if chosen is not None else None
        if predicted is not None:
            m.predicted_ttft.observe(predicted / 1e3)
        if book:
            self._book(seqs, real, decision, len(tokens), request_id, predicted, session)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s -> %s/%d overlap=%d/%d cost=%.2f temperature=%.1fms costs (instance, rank, "
                      "overlap, cost, predicted TTFT ms)=%s", request_id,
                      decision.instance, decision.dp_rank, decision.overlap_blocks,
                      decision.request_blocks, decision.cost, self.latency.error.spread_ms,
                      [(c.instance, c.dp_rank, c.overlap_blocks, round(c.cost, 2),
                        None if c.ttft_ms is None else round(c.ttft_ms, 2)) for c in decision.costs])
        return decision

    def _affinity(self, session: str, decision: RoutingDecision, book: bool) -> RoutingDecision:
        """Keep the session on its bound worker unless that worker is overloaded or gone."""
        bound = self.sessions.bound(session)
        outcome = "first"
        if bound is not None:
            here = next((c for c in decision.costs if (c.instance, c.dp_rank) == bound), None)
            if here is None or self.sessions.overloaded(here.cost, min(c.cost for c in decision.costs)):
                outcome = "moved"
                log.debug("session %s leaves %s/%d (%s)", session, bound[0], bound[1],
                          "not a candidate" if here is None else f"overloaded: cost {here.cost:.1f}")
            else:
                outcome = "kept"
                if bound != decision.worker:
                    decision = RoutingDecision(here.instance, here.dp_rank, here.overlap_blocks, here.cost,
                                               decision.request_blocks, decision.costs, decision.excluded_busy,
                                               cost_model=decision.cost_model)
        if book:
            self.sessions.bind(session, decision.worker)
        self.metrics.session_affinity.labels(outcome).inc()
        return decision

    def pin(self, tokens: Sequence[int], worker: Worker, *, request_id: str | None = None,
            lora_name: str | None = None, salt: str | None = None,
            mm: Sequence[hashing.MmSpan] | None = None) -> RoutingDecision:
        """Book a request whose worker is already fixed (pinned by the client, or the only one)."""
        seqs = hashing.sequence_hashes(tokens, self.config.block_size, lora_name, salt, mm)
        real = self.index.find_matches(seqs)
        overlap = self._with_predictions(seqs, real).get(worker, 0)
        decision = RoutingDecision(worker[0], worker[1], overlap, 0.0, len(tokens) // self.config.block_size,
                                   mode=self.mode)
        self._book(seqs, real, decision, len(tokens), request_id)
        return decision

    def _book(self, seqs: list[int], real: Mapping[Worker, int], decision: RoutingDecision, n_tokens: int,
              request_id: str | None, predicted_ttft_ms: float | None = None, session: str | None = None) -> None:
        if request_id is None:
            self._auto_id += 1
            request_id = f"auto-{self._auto_id}"
        w = decision.worker
        self.load.add_request(request_id, w, n_tokens, decision.overlap_blocks,
                              None if predicted_ttft_ms is None else (predicted_ttft_ms, self._clock()))
        if self.on_booked is not None:
            self.on_booked(request_id, w, n_tokens, decision.overlap_blocks, seqs,
                           session if self.sessions.ttl > 0 else None)
        self._predict(w, seqs, known=real.get(w, 0))

    def book_remote(self, key: str, worker: Worker, n_tokens: int, overlap_blocks: int,
                    seqs: Sequence[int], session: str | None) -> None:
        """Another frontend's booking (``actors.router.bookings``): its load on ``worker``, its
        blocks predicted there until events confirm them, its session bound there."""
        self.load.add_request(key, worker, n_tokens, overlap_blocks)
        self._predict(worker, seqs)
        if session and self.sessions.ttl > 0:
            self.sessions.bind(session, worker)

    def _predict(self, w: Worker, seqs: Sequence[int], known: int = 0) -> None:
        """Blocks a request booked on ``w`` will hold: approx mode's index records them; in kv mode they
        are predicted until events confirm them. ``known``: how many leading blocks the index already
        showed on ``w`` (kv mode skips them)."""
        if isinstance(self.index, ApproxIndex):
            self.index.record(w, seqs)
            return
        preds = self.predictions
        assert preds is not None
        index = self.index
        # Only what the events have not confirmed yet (re-predicting a block refreshes its TTL).
        todo = [h for h in seqs[known:] if not index.holds(h, w)]
        if todo:
            preds.record(w, todo)
        self.metrics.predicted_blocks.set(preds.predicted())

    def _with_predictions(self, seqs: list[int], real: dict[Worker, int]) -> dict[Worker, int]:
        """Per worker, the longest prefix of ``seqs`` held per the index or predicted."""
        preds = self.predictions
        if preds is None or not seqs or not len(preds):
            return real
        now = preds.now()
        preds.prune(now)
        index = self.index
        assert isinstance(index, KvIndex)
        cands = set(real)
        cands.update(preds.live_owners(seqs[0], now))
        out: dict[Worker, int] = {}
        end = len(seqs)
        for w in cands:
            n = real.get(w, 0)
            while n < end and (preds.holds(seqs[n], w, now) or index.holds(seqs[n], w)):
                n += 1
            if n:
                out[w] = n
        return out

    # ---- IndexView for the cost function's tie-break (cached + predicted blocks) -----------------
    def worker_blocks(self, worker: Worker) -> int:
        n = self.index.worker_blocks(worker)
        return n + self.predictions.worker_blocks(worker) if self.predictions is not None else n

    def worker_block_size(self, worker: Worker) -> int | None:
        return self.index.worker_block_size(worker)

    def first_token(self, request_id: str) -> None:
        self.load.first_token(request_id)
        if self.on_first is not None and self.load.tracks(request_id):
            self.on_first(request_id)
        pred = self.load.take_prediction(request_id)
        if pred is not None:
            self.latency.observe_ttft(1e3 * (self._clock() - pred[1]), pred[0])
            err = self.latency.error
            self.metrics.error_bias.set(err.bias_ms / 1e3)
            self.metrics.error_spread.set(err.spread_ms / 1e3)

    def add_output_tokens(self, request_id: str, n: int) -> None:
        self.load.add_output_tokens(request_id, n)

    def finish(self, request_id: str) -> None:
        out = self.load.finish(request_id)
        if self.on_finished is not None and out is not None:
            self.on_finished(request_id)
        if out:
            self.latency.observe_output(out)

    # ---- feeds -----------------------------------------------------------------------------------
    def apply_event(self, event: RouterKvEvent) -> Gap | None:
        if not isinstance(self.index, KvIndex):
            return None
        gap = self.index.apply(event)
        self._settle(event.worker, [event])
        return gap

    def apply_range(self, reply: KvRangeReply) -> Gap | None:
        if not isinstance(self.index, KvIndex):
            return None
        gap = self.index.apply_range(reply)
        self._settle((reply.instance, reply.dp_rank), reply.events)
        return gap

    def load_dump(self, instance: str, snapshot: KvSnapshot) -> Gap | None:
        """Replace one worker's blocks (the others', and every prediction, are kept)."""
        if not isinstance(self.index, KvIndex):
            return None
        gap = self.index.load_dump(instance, snapshot)
        self._settle((instance, snapshot.dp_rank), stored=[b.seq_hash for b in snapshot.blocks])
        return gap

    def _settle(self, w: Worker, events: Sequence[RouterKvEvent] = (), stored: Sequence[int] = ()) -> None:
        """End the predictions on ``w`` that these events (or dumped blocks) settle: stored blocks the
        index now holds confirm them (a buffered event confirms nothing), removed blocks contradict
        them, a cleared cache ends them all."""
        preds, index = self.predictions, self.index
        if preds is None or not len(preds) or not isinstance(index, KvIndex):
            return
        confirmed = list(stored)
        gone = 0
        for ev in events:
            if ev.kind == "stored":
                confirmed += [b.seq_hash for b in ev.stored]
            elif ev.kind == "removed":
                gone += preds.forget(w, ev.removed)
            else:
                gone += preds.forget_worker(w)
        gone += preds.forget(w, [h for h in confirmed if index.holds(h, w)])
        if gone:
            self.metrics.predicted_blocks.set(preds.predicted())

    def reconcile(self, report: LoadReport) -> None:
        """A worker's load report: its load for the next decisions, its steps for the latency model."""
        self.load.reconcile(report)
        cap = report.total_kv_blocks * self.config.block_size if report.total_kv_blocks else None
        self.latency.observe((report.instance, report.dp_rank), report.steps, cap)

    def remove_worker(self, instance: str) -> None:
        self.index.remove_worker(instance)
        self.load.remove_worker(instance)
        self.latency.remove_worker(instance)
        self.sessions.remove_worker(instance)
        if self.predictions is not None:
            self.predictions.remove_worker(instance)
            self.metrics.predicted_blocks.set(self.predictions.predicted())

    def stats(self) -> dict:
        out = {"mode": self.mode, "block_size": self.config.block_size, "index": self.index.stats(),
               "load": self.load.snapshot(),
               "cost_model": "latency" if self.config.prefill_load_scale is None else "weights",
               "latency": self.latency.stats()}
        if self.predictions is not None:
            p = self.predictions.stats()
            out["predicted"] = {"blocks": self.predictions.predicted(), "hashes": p["blocks"],
                                "ttl": p["ttl"], "workers": p["workers"]}
        return out
