"""Active load per worker, from this frontend's own routing decisions plus workers' load reports.

Per worker: *active prefill tokens* (the uncached prompt tokens of requests routed there whose
first token has not arrived yet) and *active decode blocks* (KV blocks held by requests routed
there until they finish, growing as output crosses block boundaries). Our own bookkeeping is exact
and immediate but blind to other frontends; a worker's :class:`LoadReport` sees everyone but lags.
``reconcile`` keeps the latest report, and the effective decode load is the larger of the two while
the report is fresh (``report_ttl``), so neither a burst we just sent nor another frontend's
traffic is ignored. A report taken before one of our own requests on that worker finished is
stale for the part we know best (it still counts the finished request's blocks), so it is set aside
until the worker's next report: otherwise a session's next turn, sent right after the last one
ended, would see its own finished turn as load on the worker that holds its prefix and move.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from actors.worker.contract import LoadReport

log = logging.getLogger(__name__)

Worker = tuple[str, int]


@dataclass(slots=True)
class _Req:
    worker: Worker
    prefill_tokens: int
    decode_blocks: int
    total_tokens: int
    started: float
    prompt_tokens: int = 0
    # (predicted TTFT ms, when routed by the router's clock) until its first token: the latency
    # model's error is measured there
    prediction: tuple[float, float] | None = None


@dataclass(slots=True)
class WorkerLoad:
    prefill_tokens: int = 0
    decode_blocks: int = 0
    requests: int = 0


class LoadTracker:
    def __init__(self, block_size: int, *, report_ttl: float = 5.0, request_ttl: float = 3600.0,
                 clock=time.monotonic) -> None:
        self.block_size = block_size
        self.report_ttl = report_ttl
        self.request_ttl = request_ttl
        self._clock = clock
        self._reqs: dict[str, _Req] = {}
        self._load: dict[Worker, WorkerLoad] = {}
        self._reports: dict[Worker, tuple[float, LoadReport]] = {}
        self._released: dict[Worker, float] = {}  # when our last request on the worker finished

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- our own decisions ---------------------------------------------------------------------
    def add_request(self, request_id: str, worker: Worker, prompt_tokens: int,
                    overlap_blocks: int = 0, prediction: tuple[float, float] | None = None) -> None:
        """At route time: uncached prompt tokens become prefill load, all prompt blocks decode load.
        ``prediction``: kept for ``take_prediction`` (what the router predicted, and when)."""
        if request_id in self._reqs:
            self.finish(request_id)
        prefill = max(0, prompt_tokens - overlap_blocks * self.block_size)
        r = _Req(worker, prefill, self._blocks(prompt_tokens), prompt_tokens, self._clock(), prompt_tokens,
                 prediction)
        self._reqs[request_id] = r
        wl = self._load.setdefault(worker, WorkerLoad())
        wl.prefill_tokens += prefill
        wl.decode_blocks += r.decode_blocks
        wl.requests += 1

    def first_token(self, request_id: str) -> None:
        """Prefill is done: its tokens no longer load the worker's prefill queue."""
        r = self._reqs.get(request_id)
        if r is None or r.prefill_tokens == 0:
            return
        self._load[r.worker].prefill_tokens -= r.prefill_tokens
        r.prefill_tokens = 0

    def tracks(self, request_id: str) -> bool:
        return request_id in self._reqs

    def take_prediction(self, request_id: str) -> tuple[float, float] | None:
        """The prediction ``add_request`` kept for a request still tracked, once."""
        r = self._reqs.get(request_id)
        if r is None:
            return None
        pred, r.prediction = r.prediction, None
        return pred

    def add_output_tokens(self, request_id: str, n: int) -> None:
        """Output grows the request's KV footprint by a block each ``block_size`` tokens."""
        r = self._reqs.get(request_id)
        if r is None or n <= 0:
            return
        if r.prefill_tokens:
            self.first_token(request_id)
        r.total_tokens += n
        nb = self._blocks(r.total_tokens)
        if nb != r.decode_blocks:
            self._load[r.worker].decode_blocks += nb - r.decode_blocks
            r.decode_blocks = nb

    def finish(self, request_id: str) -> int | None:
        """Finished, failed or cancelled: release everything it held (idempotent). Returns the
        request's output tokens (None if it was not tracked)."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            return None
        self._released[r.worker] = self._clock()
        wl = self._load[r.worker]
        wl.prefill_tokens -= r.prefill_tokens
        wl.decode_blocks -= r.decode_blocks
        wl.requests -= 1
        if wl.requests == 0:
            del self._load[r.worker]
        return r.total_tokens - r.prompt_tokens

    def sweep(self) -> int:
        """Drop requests older than ``request_ttl`` (a lost finish must not load a worker forever)."""
        cutoff = self._clock() - self.request_ttl
        old = [rid for rid, r in self._reqs.items() if r.started < cutoff]
        for rid in old:
            log.warning("load: request %s never finished; dropping its load", rid)
            self.finish(rid)
        return len(old)

    # ---- worker reports ------------------------------------------------------------------------
    def reconcile(self, report: LoadReport) -> None:
        self._reports[(report.instance, report.dp_rank)] = (self._clock(), report)

    def remove_worker(self, instance: str) -> None:
        for w in [w for w in self._reports if w[0] == instance]:
            del self._reports[w]
        for w in [w for w in self._released if w[0] == instance]:
            del self._released[w]
        for rid in [rid for rid, r in self._reqs.items() if r.worker[0] == instance]:
            self.finish(rid)

    def _fresh_report(self, worker: Worker, *, load: bool = False) -> LoadReport | None:
        item = self._reports.get(worker)
        if item is None or self._clock() - item[0] > self.report_ttl:
            return None
        if load and item[0] <= self._released.get(worker, float("-inf")):
            return None  # older than our latest finish there: superseded until the next report
        return item[1]

    # ---- queries -------------------------------------------------------------------------------
    def prefill_tokens(self, worker: Worker) -> int:
        wl = self._load.get(worker)
        return wl.prefill_tokens if wl else 0

    def decode_blocks(self, worker: Worker) -> int:
        wl = self._load.get(worker)
        own = wl.decode_blocks if wl else 0
        rep = self._fresh_report(worker, load=True)
        return max(own, rep.active_kv_blocks) if rep else own

    def running(self, worker: Worker) -> int:
        """Streams on the worker: ours, or all its report counts (other frontends' too) while fresh."""
        wl = self._load.get(worker)
        own = wl.requests if wl else 0
        rep = self._fresh_report(worker, load=True)
        return max(own, rep.num_running + rep.num_waiting) if rep else own

    def kv_usage(self, worker: Worker) -> float | None:
        """The worker's reported KV usage fraction (None without a fresh report)."""
        rep = self._fresh_report(worker)
        return rep.kv_usage if rep else None

    def snapshot(self) -> dict[str, dict]:
        ws = set(self._load) | set(self._reports)
        return {f"{w[0]}/{w[1]}": {"prefill_tokens": self.prefill_tokens(w),
                                   "decode_blocks": self.decode_blocks(w),
                                   "kv_usage": self.kv_usage(w),
                                   "requests": self._load[w].requests if w in self._load else 0}
                for w in sorted(ws)}
