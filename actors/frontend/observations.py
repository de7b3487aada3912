"""What this frontend saw of its engine requests, window by window: the planner's observations.

An engine request is one choice of ``n`` (``choices.Choice``). A disaggregated request counts once:
its prefill call yields no chunk to the choice, so the choice's first token is the decode worker's
first, and its TTFT runs from the request's start through prefill, transfer and that first decode.

Per engine request: ``start`` counts it in the current window; ``token`` notes each chunk with
tokens (the first gives TTFT from the request's start at the frontend; a later chunk of ``k``
tokens after a gap ``g`` gives ``k`` ITL observations of ``g / k``, so the ITL histogram counts
tokens); ``finish`` adds its prompt, generated and cached tokens; ``fail`` counts a failure. A
request whose client went away is neither finished nor failed. ``roll(now)`` hands over the window
and starts the next; the frontend actor publishes each on ``Subjects.metrics_frontend``.

Times for TTFT/ITL are ``time.perf_counter()`` seconds, as the pipeline's Prometheus histograms
use; window bounds are wall-clock seconds (``time.time()``), so windows of several frontends line
up. No NATS here.
"""

from __future__ import annotations

import time

from actors.planner.contract import FrontendWindow


class RequestObservation:
    """One engine request's observations; every call after ``finish``/``fail`` is ignored."""

    __slots__ = ("_obs", "_t0", "_last", "_closed")

    def __init__(self, obs: Observations, t0: float) -> None:
        self._obs = obs
        self._t0 = t0
        self._last: float | None = None  # when the latest token arrived
        self._closed = False

    def token(self, t: float, k: int) -> None:
        """A chunk of ``k`` tokens arrived at ``t`` (chunks without tokens say nothing of latency)."""
        if self._closed or k <= 0:
            return
        w = self._obs.window
        if self._last is None:
            w.ttft.observe((t - self._t0) * 1000.0)
        else:
            w.itl.observe((t - self._last) * 1000.0 / k, k)
        self._last = t

    def finish(self, prompt_tokens: int, generated_tokens: int, cached_tokens: int) -> None:
        if self._closed:
            return
        self._closed = True
        w = self._obs.window
        w.finished += 1
        w.isl_tokens += prompt_tokens
        w.osl_tokens += generated_tokens
        w.cached_tokens += cached_tokens

    def fail(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._obs.window.failed += 1


class Observations:
    """The current window of one frontend's engine requests."""

    def __init__(self, instance: str = "", model: str | None = None, now: float | None = None) -> None:
        self.instance = instance
        self.model = model
        self.window = self._new(time.time() if now is None else now)

    def _new(self, start: float) -> FrontendWindow:
        return FrontendWindow(instance=self.instance, model=self.model, start=start, end=start)

    def start(self, t0: float) -> RequestObservation:
        """An engine request that started at ``t0`` (perf_counter: the HTTP request's start)."""
        self.window.requests += 1
        return RequestObservation(self, t0)

    def roll(self, now: float) -> FrontendWindow:
        """The window ``[start, now)``, handed over; the next one starts at ``now``."""
        done = self.window
        done.end = now
        self.window = self._new(now)
        return done
