"""Requests for a cold model: held while a waker brings a replica back (no HTTP; the demand and
the outcomes travel through the callables and ``on_outcome`` the frontend actor wires to the bus).

A model is cold when readiness says so (``Readiness.evaluate``: every pool it lacks is asleep or
at zero replicas), not merely when no worker serves it: a model that is starting or failing is
answered at once, as before. For a cold model:

- the first held request begins a *cold period*: one ``Demand`` goes out (not one per request), and
  the period ends when the model serves again (the registry shows a ready worker), when a waker
  says its wake failed, or when ``frontend.cold.wake_timeout`` passes;
- each request waits, at most ``wake_timeout``, in a bounded queue (``max_held`` per model: more
  get 503 at once); a stream is sent an SSE comment every ``keepalive`` seconds meanwhile;
- a failed or timed-out wake ends every held request with 503 + Retry-After and the reason, and the
  same answer is given at once for ``FAILURE_HOLD_S``, so a broken pool is not spawned again for
  every request (the next request after that begins a new period).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from actors.planner.contract import Demand, WakeOutcome
from config.topology import ColdConfig

from .discovery import WorkerSet
from .metrics import FrontendMetrics
from .planning import NotReady

log = logging.getLogger(__name__)

FAILURE_HOLD_S = 10.0  # a failed wake is answered at once (503, Retry-After) for this long


def held_model(requested: str | None, expected: frozenset[str]) -> str | None:
    """The deployment's model a request names (or its only one, when it names none), or None: only
    the topology's own model is held while cold."""
    name = requested or (next(iter(expected)) if len(expected) == 1 else None)
    return name if name in expected else None


class WakeFailed(NotReady):
    """The model was cold and could not be woken (or not within ``wake_timeout``)."""

    retry_after = str(int(FAILURE_HOLD_S))


class TooManyHeld(NotReady):
    """More requests for a cold model than ``frontend.cold.max_held`` are waiting."""


@dataclass
class ColdPeriod:
    model: str
    started: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    failure: str | None = None
    held: int = 0
    cold: str = "unknown"  # what was cold: "sleep" (replicas asleep), "zero" (no replica), or both


class ColdGate:
    def __init__(self, workers: WorkerSet, config: ColdConfig, *, frontend: str,
                 is_cold: Callable[[str], Awaitable[str | None]], send: Callable[[Demand], Awaitable[None]],
                 metrics: FrontendMetrics) -> None:
        """``is_cold(model)``: what readiness says is cold ("sleep", "zero", "waking", joined by
        "+" when pools differ), None when the model is not cold; ``send``: publish a demand."""
        self.workers = workers
        self.config = config
        self.frontend = frontend
        self.is_cold = is_cold
        self.send = send
        self.metrics = metrics
        self.periods: dict[str, ColdPeriod] = {}
        self.failures: dict[str, tuple[str, float]] = {}  # model -> (reason, monotonic until)
        workers.listeners.append(self._changed)

    # --- state --------------------------------------------------------------------------------------
    def waking(self, model: str) -> bool:
        return model in self.periods

    def failure(self, model: str) -> str | None:
        """The reason of the last failed wake of ``model``, while it is still answered at once."""
        f = self.failures.get(model)
        if f is None:
            return None
        if time.monotonic() >= f[1] or self.workers.resolve_model(model) is not None:
            self.failures.pop(model, None)
            return None
        return f[0]

    # --- holding ------------------------------------------------------------------------------------
    async def hold(self, model: str, keepalive: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Wait until ``model`` serves. False at once when it is not cold (the caller answers as it
        would have); raises WakeFailed/TooManyHeld (503) when the wake fails, times out or the
        queue is full."""
        reason = self.failure(model)
        if reason is not None:
            self.metrics.held_done.labels(model, "failed").inc()
            raise WakeFailed(reason)
        if self.workers.resolve_model(model) is not None:
            return True
        cold = None if model in self.periods else await self.is_cold(model)
        if model not in self.periods and cold is None:
            return False
        period = self.periods.get(model)
        if period is None:
            if self.workers.resolve_model(model) is not None:  # served while readiness was asked
                return True
            period = self._begin(model, cold or "unknown")
        if period.held >= self.config.max_held:
            self.metrics.held_done.labels(model, "refused").inc()
            raise TooManyHeld(f"model {model} is waking up and {period.held} requests already wait for it "
                              f"(frontend.cold.max_held): retry shortly")
        period.held += 1
        gauge = self.metrics.held.labels(model)
        gauge.inc()
        outcome = "served"
        try:
            await self._wait(period, keepalive)
        except WakeFailed:
            outcome = "timeout" if "did not serve within" in (period.failure or "") else "failed"
            raise
        except BaseException:
            outcome = "gone"  # the client left (or the frontend stops)
            raise
        finally:
            period.held -= 1
            gauge.dec()
            self.metrics.held_done.labels(model, outcome).inc()
        return True

    async def _wait(self, period: ColdPeriod, keepalive: Callable[[], Awaitable[None]] | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.wake_timeout
        while not period.done.is_set():
            left = deadline - loop.time()
            if left <= 0:
                self._fail(period, f"model {period.model} did not serve within {self.config.wake_timeout:g}s "
                           f"of the wake (frontend.cold.wake_timeout; see /health)")
                break
            try:
                await asyncio.wait_for(period.done.wait(), min(left, self.config.keepalive))
            except TimeoutError:
                if keepalive is not None and not period.done.is_set() and deadline - loop.time() > 0:
                    await keepalive()
        if period.failure is not None:
            raise WakeFailed(period.failure)

    def _begin(self, model: str, cold: str) -> ColdPeriod:
        period = self.periods[model] = ColdPeriod(model, cold=cold)
        self.metrics.cold_starts.labels(model).inc()
        demand = Demand(model=model, frontend=self.frontend, held=1, wake_timeout=self.config.wake_timeout,
                        ts=time.time())
        log.info("model %s is cold (%s): holding its requests and asking for a wake", model, cold)

        async def send() -> None:
            try:
                await self.send(demand)
            except Exception as e:  # noqa: BLE001 - nothing will wake it: the period times out
                log.warning("wake demand for %s not sent: %s", model, e)

        asyncio.get_running_loop().create_task(send(), name=f"demand:{model}")
        return period

    def _fail(self, period: ColdPeriod, reason: str) -> None:
        if self.periods.get(period.model) is period:
            del self.periods[period.model]
        if period.failure is None:
            period.failure = reason
            log.warning("model %s: %s (%d held request(s) get 503)", period.model, reason, period.held)
        self.failures[period.model] = (reason, time.monotonic() + FAILURE_HOLD_S)
        period.done.set()

    # --- inputs -------------------------------------------------------------------------------------
    def on_outcome(self, o: WakeOutcome) -> None:
        """A waker's outcome: a failed wake or spawn ends the period of its model."""
        if o.action == "stop" or o.outcome != "failed":
            return
        for model, period in list(self.periods.items()):
            if o.model is not None and o.model != model:
                continue
            what = "start a replica" if o.action == "spawn" else "wake a replica"
            self._fail(period, f"model {model} is cold and the waker could not {what} of pool {o.pool}: "
                       f"{o.error or 'no reason given'}")

    def _changed(self) -> None:
        """The registry changed: a period whose model serves now ends, and its requests go on."""
        for model, period in list(self.periods.items()):
            if self.workers.resolve_model(model) is None:
                continue
            del self.periods[model]
            self.failures.pop(model, None)
            took = time.monotonic() - period.started
            self.metrics.wake_seconds.labels(model, period.cold).observe(took)
            log.info("model %s serves again after %.2fs cold (%s); %d held request(s) go on", model, took,
                     period.cold, period.held)
            period.done.set()
