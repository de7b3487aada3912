"""The profiler's measurements: one engine swept over prompt lengths and concurrencies, as the
planner's throughput mode needs them (``actors.planner.contract.PrefillPoint``/``DecodePoint``).

- Prefill point (isl, c): ``c`` requests of ``isl`` uncached prompt tokens kept in flight, each
  asking for one token; mean TTFT and prompt tokens per second over the point.
- Decode point (context, c): waves of ``c`` requests started together, each generating ``osl``
  tokens (``ignore_eos``) from an ``isl``-token prompt, so a request's context is
  ``isl + osl/2`` on average while it decodes; mean ITL (the first token excluded) and generated
  tokens per second, all requests together.

Which points an engine can hold is decided up front (``plan``): a point whose requests do not fit
the model length, the KV cache or ``max_num_seqs`` would measure queueing or preemption instead of
the engine, so it is skipped with its reason.

The engine is reached through ``Target`` (a stream of ``GenerateChunk`` per request), so the
logic here knows no NATS; ``actors.planner.profile`` binds it to a worker's generate subject.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from actors.engines.protocol import SamplingOptions
from actors.planner.contract import DecodePoint, PrefillPoint
from actors.worker.contract import GenerateChunk, GenerateRequest
from bus.tasks import cancel_and_wait

T = TypeVar("T")


class Stream(Protocol):
    """One request's chunks; ``aclose`` ends it early (the engine aborts the request)."""

    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...

    async def aclose(self) -> None: ...


class Target(Protocol):
    def stream(self, req: GenerateRequest) -> Stream: ...


@dataclass(frozen=True)
class Limits:
    """What one engine holds (from its model card and engine args)."""

    max_model_len: int
    kv_capacity_tokens: int  # 0: unknown (no KV check)
    max_num_seqs: int


@dataclass(frozen=True)
class Sweep:
    isls: Sequence[int]
    concurrencies: Sequence[int]
    osl: int
    requests: int | None = None  # per point; None: max(8, 4 x concurrency)
    prefill: bool = True  # prefill points (prefill and agg pools)
    decode: bool = True  # decode points (decode and agg pools)

    def requests_for(self, concurrency: int) -> int:
        n = self.requests if self.requests is not None else max(8, 4 * concurrency)
        return max(n, concurrency)


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill" | "decode"
    isl: int
    concurrency: int

    def describe(self, osl: int) -> str:
        if self.kind == "prefill":
            return f"prefill isl={self.isl} concurrency={self.concurrency}"
        return f"decode context={decode_context(self.isl, osl)} concurrency={self.concurrency}"


def decode_context(isl: int, osl: int) -> int:
    """A decode point's context: the prompt plus half the output, the mean while decoding."""
    return isl + osl // 2


def plan(sweep: Sweep, limits: Limits) -> tuple[list[Point], list[tuple[Point, str]]]:
    """(points to measure, skipped points with the reason) in measuring order: prefill points by
    ISL then concurrency, then decode points the same way."""
    run: list[Point] = []
    skipped: list[tuple[Point, str]] = []
    kinds = [k for k, on in (("prefill", sweep.prefill), ("decode", sweep.decode)) if on]
    for kind in kinds:
        for isl in sweep.isls:
            for c in sweep.concurrencies:
                p = Point(kind, isl, c)
                why = _unfit(p, sweep.osl, limits)
                if why:
                    skipped.append((p, why))
                else:
                    run.append(p)
    return run, skipped


def _unfit(p: Point, osl: int, lim: Limits) -> str | None:
    # a request holds its prompt and what it generated: the peak, not the mean context, must fit,
    # or the engine would preempt and the point would measure recomputation
    per_request = p.isl + (1 if p.kind == "prefill" else osl)
    if per_request > lim.max_model_len:
        return f"{per_request} tokens per request > max_model_len {lim.max_model_len}"
    if p.concurrency > lim.max_num_seqs:
        return f"concurrency {p.concurrency} > max_num_seqs {lim.max_num_seqs}"
    if lim.kv_capacity_tokens and p.concurrency * per_request > lim.kv_capacity_tokens:
        return (f"{p.concurrency} x {per_request} tokens > KV capacity {lim.kv_capacity_tokens} "
                f"tokens")
    return None


@dataclass
class Prompts:
    """Token-id prompts that share no prefix with each other (nor with anything the engine has
    cached from an earlier run): the first two tokens count up, the rest is random."""

    vocab_size: int
    avoid: frozenset[int] = frozenset()  # ids a prompt must not hold (the mocker's poison id)
    seed: int = 0
    _n: int = 0
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        # ids 0..9 are special tokens in most vocabularies
        self._ids = [i for i in range(min(10, self.vocab_size - 1), self.vocab_size) if i not in self.avoid]
        if len(self._ids) < 2:
            raise ValueError(f"vocabulary of {self.vocab_size} ids leaves no prompt tokens")
        self._start = self._rng.randrange(len(self._ids) ** 2)  # a fresh prefix space per run

    def make(self, isl: int) -> list[int]:
        k = self._start + self._n
        self._n += 1
        v = len(self._ids)
        head = [self._ids[k % v], self._ids[(k // v) % v]]
        return (head + [self._rng.choice(self._ids) for _ in range(max(0, isl - 2))])[:isl]


@dataclass
class Timing:
    """One request as the caller saw it (perf_counter seconds)."""

    sent: float
    first: float | None = None  # first generated token
    last: float | None = None  # last generated token
    tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent

    @property
    def itl(self) -> float | None:
        """Mean gap between generated tokens after the first (None with fewer than two)."""
        if self.tokens < 2 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (self.tokens - 1)


async def timed(target: Target, req: GenerateRequest) -> Timing:
    t = Timing(sent=time.perf_counter())
    call = target.stream(req)
    try:
        async for chunk in call:
            now = time.perf_counter()
            if chunk.token_ids:
                if t.first is None:
                    t.first = now
                t.last = now
                t.tokens += len(chunk.token_ids)
            if chunk.usage is not None:
                t.cached_tokens = chunk.usage.cached_tokens
    finally:
        await call.aclose()
    if t.first is None:
        raise RuntimeError(f"request {req.request_id} ended without a token")
    return t


def request(prompt: list[int], max_tokens: int, rid: str) -> GenerateRequest:
    # token mode without detokenizing, as the frontend sends it; ignore_eos so every request
    # generates exactly max_tokens
    return GenerateRequest(request_id=rid, token_ids=prompt,
                           sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True, detokenize=False))


@dataclass
class Sweeper:
    target: Target
    prompts: Prompts
    osl: int
    on_cached: Callable[[str, int], None] | None = None  # a point whose prompts hit a cache
    _seq: int = 0

    def _rid(self, tag: str) -> str:
        self._seq += 1
        return f"profile-{tag}-{self._seq}"

    async def warm_up(self, isl: int, decode: bool) -> None:
        """One request before measuring: a fresh engine's first request pays one-off costs."""
        await timed(self.target, request(self.prompts.make(isl), min(self.osl, 8) if decode else 1,
                                         self._rid("warmup")))

    async def prefill(self, isl: int, concurrency: int, n: int) -> PrefillPoint:
        """``n`` requests, ``concurrency`` of them in flight at any time (closed loop)."""
        left = n
        timings: list[Timing] = []

        async def lane() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                timings.append(await timed(self.target, request(self.prompts.make(isl), 1, self._rid("p"))))

        start = time.perf_counter()
        await _all([lane() for _ in range(concurrency)])
        wall = time.perf_counter() - start
        self._check_cached(f"prefill isl={isl} concurrency={concurrency}", timings)
        return PrefillPoint(isl=isl, concurrency=concurrency,
                            ttft_ms=1000.0 * sum(t.ttft for t in timings) / len(timings),
                            tokens_per_s=isl * len(timings) / wall)

    async def decode(self, isl: int, concurrency: int, n: int) -> DecodePoint:
        """Waves of ``concurrency`` requests started together (``ceil(n / concurrency)`` waves):
        they prefill together and then decode side by side, so the batch stays at ``concurrency``
        while ITL is measured."""
        itls: list[float] = []
        tokens = 0
        span = 0.0
        every: list[Timing] = []
        for _ in range(math.ceil(n / concurrency)):
            wave = await _all([timed(self.target, request(self.prompts.make(isl), self.osl, self._rid("d")))
                               for _ in range(concurrency)])
            every += wave
            itls += [x for x in (t.itl for t in wave) if x is not None]
            tokens += sum(max(0, t.tokens - 1) for t in wave)
            span += max(t.last or 0.0 for t in wave) - min(t.first or 0.0 for t in wave)
        context = decode_context(isl, self.osl)
        self._check_cached(f"decode context={context} concurrency={concurrency}", every)
        if not itls or span <= 0:
            raise RuntimeError(f"decode context={context} concurrency={concurrency}: fewer than two "
                               f"tokens per request (osl {self.osl})")
        return DecodePoint(context=context, concurrency=concurrency,
                           itl_ms=1000.0 * sum(itls) / len(itls), tokens_per_s=tokens / span)

    def _check_cached(self, what: str, timings: list[Timing]) -> None:
        cached = sum(t.cached_tokens for t in timings)
        if cached and self.on_cached is not None:
            self.on_cached(what, cached)


async def _all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run together; the first failure (or a cancel of the caller) stops the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await cancel_and_wait(tasks)
