"""What a request would cost on each worker, in milliseconds: the router's latency predictor.

A worker's scheduler step is modelled as a line learned online from the step samples its load
reports carry (``StepSample``, the same ones the load-mode planner fits)::

    step_ms = base + prefill_base·[step computes prompt tokens] + per_prefill·prefill_tokens
              + per_kv·kv_tokens

``base`` is what any step costs, ``prefill_base`` what a step pays once for computing prompt tokens,
``per_prefill`` each prompt token computed, ``per_kv`` each KV token the running streams attend to.
The fit is exponentially weighted least squares (the newest ~1,000 steps count most), pulled
toward the defaults by a prior worth one step: before a worker's first sample the defaults
rule, and a feature the samples never vary (no prefill seen yet) keeps its default. A coefficient
the data would make negative is held at zero (a step does not get faster with more work).

From the line, for a request of ``prompt`` tokens of which ``uncached`` are not in the worker's cache,
on a worker with ``queued`` prompt tokens still to prefill, ``kv`` KV tokens in use and ``running``
streams:

- **TTFT** = half the current decode step (the step in flight when it arrives) + the steps that
  prefill the queue ahead of it + the steps that prefill its own uncached tokens (charged as steps
  of its own after the queue's: an upper bound, as it may share the queue's last step);
- **the ITL cost to the streams it already runs**: one more decode makes every step attend to its
  KV too, so each running stream's next token waits ``per_kv`` × ``prompt`` longer; and the prefill
  it would compute there although another candidate holds those tokens cached (``wasted``) delays
  each of them by ``per_prefill`` × ``wasted``: work any other choice avoids;
- **capacity**: when its KV would not fit the worker's free cache, it waits for a stream to end
  (the learned mean output length × the decode step).

The router picks the lowest TTFT + ITL cost to the running streams. Everything is in milliseconds of
this worker's measured time, so nothing needs tuning per deployment: a cache hit is worth exactly
the prefill it saves, and load is worth the delay it causes. How right the TTFT predictions turn out
is measured too (``PredictionError``); among workers whose caches offer the same, the router samples
within that error rather than trusting differences the model cannot resolve (``actors.router.cost``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from actors.engines.protocol import StepSample

Worker = tuple[str, int]

# features are scaled to thousands of tokens so the normal equations stay well conditioned
_K = 1000.0
DECAY = 0.999  # per step: the newest ~1,000 steps weigh most (a few seconds at engine step rates)
PRIOR_STEPS = 1.0  # the defaults weigh as much as one step: enough to hold a feature never seen
MIN_STEPS = 20  # a worker's own fit is used once it has seen this many steps; the pool's until then
DEFAULT_CHUNK = 2048  # prompt tokens per step before a prefill step was seen (vLLM's smallest default)
ERROR_ALPHA = 0.01  # the prediction error follows the newest ~100 requests


@dataclass(frozen=True, slots=True)
class StepLine:
    """Step time in ms: ``base + prefill_base·[prefill] + per_prefill·tokens + per_kv·kv_tokens``."""

    base: float
    prefill_base: float
    per_prefill: float  # ms per prompt token computed
    per_kv: float  # ms per KV token attended in a step

    def decode_ms(self, kv_tokens: float) -> float:
        return self.base + self.per_kv * kv_tokens

    def as_vector(self) -> np.ndarray:
        return np.array([self.base, self.prefill_base, self.per_prefill * _K, self.per_kv * _K])

    @classmethod
    def from_vector(cls, v: np.ndarray) -> StepLine:
        v = np.maximum(v, 0.0)
        return cls(float(v[0]), float(v[1]), float(v[2]) / _K, float(v[3]) / _K)


def default_line(capacity_tokens: int | None) -> StepLine:
    """The safe guess before any step is seen: 15 µs per prompt token (the slope of the mocker's
    default prefill curve, Dynamo's profile of a mid-size model on one GPU), 2 ms more for a step that
    prefills, a 6 ms decode step that doubles when the KV cache (the card's capacity) is full. Safe
    means: every cached block is worth its prefill and load still spreads, so routing is sensible
    from the first request; the first load reports (about a second) replace it."""
    per_kv = 6.0 / capacity_tokens if capacity_tokens else 6.0 / 65536
    return StepLine(base=6.0, prefill_base=2.0, per_prefill=0.015, per_kv=per_kv)


class StepFit:
    """Exponentially weighted least squares of step time on the four features, with a prior."""

    def __init__(self, prior: StepLine, decay: float = DECAY, prior_steps: float = PRIOR_STEPS) -> None:
        self.decay = decay
        self.prior_steps = prior_steps
        self._prior = prior.as_vector()
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self.steps = 0  # samples seen (not decayed)
        self.max_prefill = 0  # the largest prefill a step was seen to take: the engine's chunk is at least this
        self._line: StepLine | None = prior

    def add(self, samples: Iterable[StepSample]) -> int:
        kept = [s for s in samples
                if math.isfinite(s.elapsed_ms) and s.elapsed_ms >= 0 and (s.prefill_tokens or s.decode_requests)]
        if not kept:
            return 0
        rows = [(1.0, 1.0 if s.prefill_tokens > 0 else 0.0, s.prefill_tokens / _K, s.kv_tokens / _K,
                 s.elapsed_ms) for s in kept]
        a = np.asarray(rows)
        x, y = a[:, :4], a[:, 4]
        n = len(rows)
        w = self.decay ** np.arange(n - 1, -1, -1, dtype=float)  # the newest sample weighs 1
        fade = self.decay ** n
        self._xtx = fade * self._xtx + (x * w[:, None]).T @ x
        self._xty = fade * self._xty + (x * w[:, None]).T @ y
        self.steps += n
        self.max_prefill = max(self.max_prefill, max(s.prefill_tokens for s in kept))
        self._line = None
        return n

    def absorb(self, other: StepFit) -> None:
        """Add another fit's (decayed) sums: a pool's line from its workers' samples."""
        self._xtx = self._xtx + other._xtx
        self._xty = self._xty + other._xty
        self.steps += other.steps
        self.max_prefill = max(self.max_prefill, other.max_prefill)
        self._line = None

    @property
    def line(self) -> StepLine:
        if self._line is None:
            # ridge toward the prior: (XᵀWX + λI)θ = XᵀWy + λθ₀, then coefficients held at >= 0
            lam = self.prior_steps
            theta = np.linalg.solve(self._xtx + lam * np.eye(4), self._xty + lam * self._prior)
            if (theta < 0).any():  # refit with the negative ones fixed at zero
                keep = theta >= 0
                sub = np.linalg.solve((self._xtx + lam * np.eye(4))[np.ix_(keep, keep)],
                                      (self._xty + lam * self._prior)[keep])
                theta = np.zeros(4)
                theta[keep] = sub
            self._line = StepLine.from_vector(theta)
        return self._line


class PredictionError:
    """How far the TTFTs the router predicts are from the ones it then sees (actual − predicted, in ms):
    an exponentially weighted mean (the bias: transport and frontend time the step line does not
    model, taken to be the same on every worker) and spread (standard deviation around it).

    The spread is the router's sampling temperature among workers whose caches offer the same
    (``actors.router.cost``): load differences smaller than it are ones the model cannot tell apart.
    Always taking the cheapest kept every worker in lock-step under closed-loop load: the streams a
    burst started on all workers ended together and their successors arrived together again (TTFT
    p99 after the start 1.1-1.9x round robin's in five runs on prompts that share nothing);
    sampling within the model's own error lets the workers drift apart, as round robin's imbalance
    does. Until two TTFTs are measured the spread is 0: the router trusts its predictions, so a
    burst at a cold start is spread evenly (a prior of one default prefill step, 38.7 ms, sampled
    that burst unevenly: hardly better where prompt lengths vary, worse where they are equal)."""

    def __init__(self, alpha: float = ERROR_ALPHA) -> None:
        self.alpha = alpha
        self.samples = 0
        self.bias_ms = 0.0
        self._var = 0.0

    def observe(self, actual_ms: float, predicted_ms: float) -> None:
        r = actual_ms - predicted_ms
        if not math.isfinite(r):
            return
        self.samples += 1
        a = max(self.alpha, 1.0 / self.samples)  # a plain mean at first, then the newest ~1/alpha
        d = r - self.bias_ms
        self.bias_ms += a * d
        self._var = (1 - a) * (self._var + a * d * d)

    @property
    def spread_ms(self) -> float:
        return math.sqrt(self._var)


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker's load when it prices a request there."""

    queued_prefill: int  # prompt tokens routed there and not yet prefilled
    kv_tokens: int  # KV tokens its running streams hold
    running: int  # streams it runs
    capacity_tokens: int | None  # KV capacity (None: unknown)


@dataclass(frozen=True, slots=True)
class Estimate:
    ttft_ms: float
    stream_cost_ms: float  # the delay this request adds to the running streams' next tokens
    wait_ms: float  # waiting for KV room (part of ttft_ms)
    source: str  # "worker", "pool" or "default": which line priced it

    @property
    def cost(self) -> float:
        return self.ttft_ms + self.stream_cost_ms


class LatencyModel:
    """Per-worker step lines learned from load reports; a new worker borrows the pool's line."""

    def __init__(self, *, decay: float = DECAY, min_steps: int = MIN_STEPS) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self._fits: dict[Worker, StepFit] = {}
        self._capacity: dict[Worker, int] = {}
        self._default_capacity: int | None = None
        self._pool: StepFit | None = None  # rebuilt lazily from the workers' fits
        self.mean_output = 256.0  # output tokens per request, learned from finished requests
        self._outputs_seen = 0
        self.error = PredictionError()

    # ---- learning ---------------------------------------------------------------------------------
    def set_default_capacity(self, tokens: int | None) -> None:
        """The model card's KV capacity (total blocks × block size), for the defaults."""
        self._default_capacity = tokens

    def observe(self, worker: Worker, steps: Iterable[StepSample], capacity_tokens: int | None = None) -> int:
        """A load report's steps (and the worker's KV capacity, which the report tells)."""
        if capacity_tokens:
            self._capacity[worker] = capacity_tokens
        fit = self._fits.get(worker)
        if fit is None:
            fit = self._fits[worker] = StepFit(default_line(capacity_tokens or self._default_capacity), self.decay)
        n = fit.add(steps)
        if n:
            self._pool = None
        return n

    def observe_output(self, tokens: int) -> None:
        """A finished request's output length: the mean is how long a stream holds its KV."""
        if tokens <= 0:
            return
        self._outputs_seen += 1
        alpha = max(0.01, 1.0 / self._outputs_seen)  # a plain mean at first, then the newest ~100
        self.mean_output += alpha * (tokens - self.mean_output)

    def observe_ttft(self, actual_ms: float, predicted_ms: float) -> None:
        """A routed request's first token arrived ``actual_ms`` after it was routed."""
        self.error.observe(actual_ms, predicted_ms)

    def remove_worker(self, instance: str) -> None:
        for w in [w for w in self._fits if w[0] == instance]:
            del self._fits[w]
            self._pool = None
        for w in [w for w in self._capacity if w[0] == instance]:
            del self._capacity[w]

    # ---- lines ------------------------------------------------------------------------------------
    def capacity(self, worker: Worker) -> int | None:
        return self._capacity.get(worker, self._default_capacity)

    def _pool_fit(self) -> StepFit | None:
        if self._pool is None:
            fits = [f for f in self._fits.values() if f.steps]
            if not fits:
                return None
            pool = StepFit(default_line(self._default_capacity), self.decay)
            for f in fits:
                pool.absorb(f)
            self._pool = pool
        return self._pool

    def fit_for(self, worker: Worker) -> tuple[StepFit | None, str]:
        """The worker's own fit once it has ``min_steps`` samples, else the pool's, else none."""
        fit = self._fits.get(worker)
        if fit is not None and fit.steps >= self.min_steps:
            return fit, "worker"
        pool = self._pool_fit()
        if pool is not None and pool.steps >= self.min_steps:
            return pool, "pool"
        return None, "default"

    def line(self, worker: Worker) -> tuple[StepLine, int, str]:
        """(step line, prefill chunk in tokens, which line) for pricing a request on ``worker``."""
        fit, source = self.fit_for(worker)
        if fit is None:
            return default_line(self.capacity(worker)), DEFAULT_CHUNK, source
        # the largest prefill seen is a floor of the chunk, not the chunk: a router that has seen only
        # health canaries (1-token prompts; a frontend process started after the workers) would
        # otherwise price a 100-token prompt as 100 steps. No vLLM default chunk is below DEFAULT_CHUNK.
        return fit.line, max(fit.max_prefill, DEFAULT_CHUNK), source

    # ---- pricing ----------------------------------------------------------------------------------
    def estimate(self, worker: Worker, state: WorkerState, prompt: int, uncached: int,
                 wasted: int = 0) -> Estimate:
        """``wasted``: of ``uncached``, the tokens another candidate holds cached (avoidable work)."""
        line, chunk, source = self.line(worker)
        decode = line.decode_ms(state.kv_tokens)
        prefill_step = line.base + line.prefill_base + line.per_kv * state.kv_tokens

        def prefill_ms(tokens: int) -> float:
            if tokens <= 0:
                return 0.0
            return math.ceil(tokens / chunk) * prefill_step + line.per_prefill * tokens

        # its own prefill needs at least one step, even when every block is cached (the last token)
        own_steps = max(1, math.ceil(uncached / chunk))
        ttft = 0.5 * decode + prefill_ms(state.queued_prefill) + own_steps * prefill_step \
            + line.per_prefill * uncached
        wait = 0.0
        cap = state.capacity_tokens
        if cap and state.kv_tokens + prompt > cap and state.running:
            wait = self.mean_output * decode  # no room: a running stream must end first
            ttft += wait
        # Its prefill stalls the running streams too, but only the avoidable part is charged: the
        # prefill of tokens another worker holds cached (``wasted``). Charged with all of it, the
        # router sent every new request to the worker running the fewest streams however long its
        # queue of prefills (TTFT p50 1.7-1.8x round robin's on prompts that share nothing, at
        # a quarter of bench/routing_bench.py's random workload); charged
        # with none, a cache hit was worth only its own TTFT and a queued prefill ahead of it
        # outweighed it (84 % of the oracle's hit rate on shared prefixes; 99 % with this charge).
        per_stream = line.per_kv * prompt + line.per_prefill * wasted
        return Estimate(ttft, state.running * per_stream, wait, source)

    def stats(self) -> dict:
        out: dict[str, dict] = {}
        for w, f in sorted(self._fits.items()):
            ln = f.line
            out[f"{w[0]}/{w[1]}"] = {"steps": f.steps, "chunk": max(f.max_prefill, DEFAULT_CHUNK), "base_ms": round(ln.base, 3),
                                    "prefill_base_ms": round(ln.prefill_base, 3),
                                    "per_prefill_token_us": round(ln.per_prefill * 1e3, 4),
                                    "per_kv_token_us": round(ln.per_kv * 1e3, 5)}
        e = self.error
        return {"workers": out, "mean_output_tokens": round(self.mean_output, 1),
                "ttft_error": {"samples": e.samples, "bias_ms": round(e.bias_ms, 2),
                               "spread_ms": round(e.spread_ms, 2)}}
