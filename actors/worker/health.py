"""Health monitor: passive check + active liveness probe; escalates to the worker supervisor.

vLLM's ``check_health()`` only reads an "errored" flag, so an engine whose core hangs passes it.
The monitor therefore also runs a liveness probe — a one-token generate with a deadline — through
the same NATS subject real traffic uses (an encode worker, which generates nothing, encodes its
built-in image through its encode subject instead). On death or timeout it publishes ``escalate`` to its worker
supervisor, which restarts the engine subtree (rest_for_one) with backoff.

``HealthChecker`` is the logic (no NATS); ``HealthMonitor`` is the actor wiring it to the bus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from actors.base import Actor, Endpoint
from actors.engines.protocol import MultiModalInput, SamplingOptions
from actors.worker import contract as C
from actors.worker.contract import (
    EmbedReply,
    EmbedRequest,
    EncodeReply,
    EncodeRequest,
    EngineDead,
    GenerateChunk,
    GenerateRequest,
    HealthReply,
    LivenessReply,
)
from bus import rpc
from bus.context import BusContext
from bus.errors import ActorError, Overloaded, RequestTimeout, StreamStalled, TransportError
from bus.tasks import cancel_and_wait
from config.topology import HealthConfig

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[HealthReply]]
Probe = Callable[[float], Awaitable[None]]  # raises on failure; argument: deadline in seconds
Escalate = Callable[[str], Awaitable[None]]


class HealthChecker:
    """One tick every ``interval``: check (bounded by ``timeout``), then liveness.

    Liveness: with requests in flight, the engine must have produced output within ``timeout``
    (traffic is the probe); when idle, a one-token probe must finish within ``timeout``.
    Escalation rules: a check that times out, a hang (stalled traffic or probe timeout) escalates at
    once; "engine dead" (an unhealthy check or a probe answered EngineDead) escalates when seen on two
    ticks in a row (the engine actor fails itself on death, so a single sighting is usually already
    being handled). After escalating it waits for a live engine before escalating again, so one
    failure is one restart.
    """

    def __init__(self, check: Check, probe: Probe, escalate: Escalate, config: HealthConfig) -> None:
        self.check, self.probe, self.escalate_fn = check, probe, escalate
        self.config = config
        self.failures = 0
        self.escalations = 0
        self.last_ok = 0.0
        self.message = ""
        self.state: str = "starting"  # starting | ok | failing
        self._unhealthy_streak = 0
        self._escalated = False
        self._idle_since: float | None = None
        self.canary_ok: bool | None = None  # None: no canary run yet (or canary off)

    @property
    def ready(self) -> bool:
        if self.state != "ok":
            return False
        return self.config.canary_after_idle is None or self.canary_ok is not False

    def verdict(self) -> LivenessReply:
        if self.ready:
            status = "ok"
        elif self.state == "failing" or self.canary_ok is False:
            status = "failing"
        else:
            status = "starting"
        return LivenessReply(status=status, last_ok=self.last_ok, failures=self.failures,  # type: ignore[arg-type]
                             message=self.message)

    async def _escalate(self, reason: str) -> None:
        self.failures += 1
        self.state, self.message = "failing", reason
        if self._escalated:
            return
        self._escalated = True
        self.escalations += 1
        log.error("health: escalating: %s", reason)
        try:
            await self.escalate_fn(reason)
        except Exception as e:  # noqa: BLE001 - keep watching; the next tick tries again
            log.error("health: escalate failed: %s", e)
            self._escalated = False

    async def _dead_sighting(self, reason: str) -> None:
        self._unhealthy_streak += 1
        if self._unhealthy_streak >= 2:
            await self._escalate(reason)
        else:
            self.state, self.message = "failing", reason

    async def tick(self) -> None:
        timeout = self.config.timeout
        try:
            reply = await asyncio.wait_for(self.check(), timeout + 2.0)
        except (TimeoutError, RequestTimeout):
            await self._escalate(f"health check timed out after {timeout:g}s")
            return
        except TransportError as e:
            # nobody answers: the engine actor is (re)starting under the supervisor already
            self.state, self.message = "starting", str(e)
            self._unhealthy_streak = 0
            return
        except ActorError as e:
            await self._escalate(f"health check failed: {e}")
            return
        if reply.status == "unhealthy":
            await self._dead_sighting(reply.message or "engine unhealthy")
            return
        if reply.status in ("starting", "sleeping"):
            self.state, self.message = ("starting" if reply.status == "starting" else "ok"), reply.status
            return
        if reply.in_flight and reply.stalled_for >= timeout:
            await self._escalate(f"engine produced nothing for {reply.stalled_for:g}s with {reply.in_flight} "
                                 f"request(s) in flight (engine hung)")
            return
        if reply.in_flight:
            # real traffic is making progress: that is liveness, no probe needed (a probe on a prefill
            # worker would also hold KV blocks for a decode that never comes)
            self._alive()
            return
        try:
            await self.probe(timeout)
        except TimeoutError:
            await self._escalate(f"liveness probe got no token within {timeout:g}s (engine hung)")
            return
        except EngineDead as e:
            await self._dead_sighting(f"liveness probe: {e}")
            return
        except (Overloaded, TransportError) as e:
            # busy or restarting: not evidence of a hang
            self.message = f"probe skipped: {e}"
            return
        except ActorError as e:
            await self._escalate(f"liveness probe failed: {e}")
            return
        self._alive()
        await self._maybe_canary(reply)

    def _alive(self) -> None:
        self.state, self.message, self.last_ok = "ok", "", time.time()
        self._escalated = False
        self._unhealthy_streak = 0

    async def _maybe_canary(self, reply: HealthReply) -> None:
        """Readiness canary: after ``canary_after_idle`` seconds without traffic, one more probe."""
        after = self.config.canary_after_idle
        if after is None:
            return
        now = time.monotonic()
        # the probe itself is one request, so "idle" means nothing beyond it
        if reply.num_running + reply.num_waiting > 0:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
            return
        if now - self._idle_since < after:
            return
        self._idle_since = now
        try:
            await self.probe(self.config.timeout)
            self.canary_ok = True
        except Exception as e:  # noqa: BLE001 - any failure makes the worker not ready
            self.canary_ok = False
            self.message = f"canary failed: {e}"

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            await self.tick()
            await asyncio.sleep(max(0.0, self.config.interval - (time.monotonic() - t0)))


def probe_request(n: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"probe-{n}-{time.monotonic_ns()}", token_ids=[1],
                           sampling=SamplingOptions(max_tokens=1, temperature=0.0, detokenize=False),
                           probe=True)


def probe_embed_request(n: int) -> EmbedRequest:
    """An embedding worker's probe: a one-token prompt (token 1: any vocabulary has it)."""
    return EmbedRequest(request_id=f"probe-{n}-{time.monotonic_ns()}", token_ids=[1], probe=True)


def probe_encode_request(n: int) -> EncodeRequest:
    """An encode worker's probe: it encodes its own built-in image (EncodeRequest.probe)."""
    return EncodeRequest(request_id=f"probe-{n}-{time.monotonic_ns()}", token_ids=[], probe=True,
                         mm=MultiModalInput(images=[], source_ids=[], prompt_len=0, placeholders=[]))


async def consume_probe(chunks: object, deadline: float) -> None:
    """Read a probe stream until its final chunk, within ``deadline`` seconds (TimeoutError)."""

    async def drain() -> None:
        async for chunk in chunks:  # type: ignore[attr-defined]
            if isinstance(chunk, GenerateChunk) and chunk.finish_reason is not None:
                return

    await asyncio.wait_for(drain(), deadline)


async def probe_worker(bus: BusContext, pool_name: str, instance: str, role: str, n: int, deadline: float) -> None:
    """One probe through the worker's own routed subject, as a request reaches it: a one-token
    generate, or for an encode worker the encoding of its built-in image. TimeoutError when it does
    not finish within ``deadline`` seconds (a hang, not a transport failure: those propagate)."""
    if role in ("encode", "embed"):
        verb, req, reply = ((C.VERB_ENCODE, probe_encode_request(n), EncodeReply) if role == "encode"
                            else (C.VERB_EMBED, probe_embed_request(n), EmbedReply))
        try:
            await rpc.request(bus.nc, bus.subjects.worker(instance, verb), req,
                              timeout=deadline, msgpack=True, reply_type=reply)
        except RequestTimeout as e:
            raise TimeoutError(str(e)) from None
        return
    call = rpc.stream_request(bus.nc, bus.subjects.generate_instance(pool_name, instance), probe_request(n),
                              stall_timeout=deadline, chunk_type=GenerateChunk)
    try:
        await consume_probe(call, deadline)
    except StreamStalled as e:
        raise TimeoutError(str(e)) from None
    finally:
        await call.aclose()


class HealthMonitor(Actor):
    """Watches one engine actor over NATS; escalates to the worker supervisor on death or hang."""

    kind = "health"
    description = "engine health monitor: check_health + liveness probe, escalates to the supervisor"

    def __init__(self, bus: BusContext, *, engine_instance: str, pool_name: str, config: HealthConfig,
                 escalate_subject: str | None, child_id: str = "engine", role: str = "", model: str = "",
                 instance: str | None = None) -> None:
        super().__init__(bus, instance=instance or f"health-{engine_instance}", role=role, model=model,
                         max_concurrency=8, drain_timeout=1.0)
        self.engine_instance = engine_instance
        self.pool_name = pool_name
        self.escalate_subject = escalate_subject
        self.child_id = child_id
        self.checker = HealthChecker(self._check, self._probe, self._escalate, config)
        self._task: asyncio.Task[None] | None = None
        self._n = 0

    def record(self) -> dict[str, Any]:
        return {**super().record(), "pool": self.pool_name, "engine_instance": self.engine_instance}

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "engine_instance": self.engine_instance}

    def statistics(self) -> dict[str, Any]:
        c = self.checker
        return {"state": c.state, "failures": c.failures, "escalations": c.escalations, "last_ok": c.last_ok,
                "ready": c.ready}

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint("liveness", self.bus.subjects.worker(self.engine_instance, C.VERB_LIVENESS),
                         self.liveness, queue_group=None, bounded=False)]

    async def liveness(self, _req: Any, _h: Any) -> LivenessReply:
        return self.checker.verdict()

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self.checker.run(), name=f"{self.instance}-loop")

    async def on_stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _check(self) -> HealthReply:
        subject = self.bus.subjects.worker(self.engine_instance, C.VERB_HEALTH)
        # a little longer than the engine actor's own check_health bound, so its "unhealthy" wins
        return await rpc.request(self.bus.nc, subject, {}, timeout=self.checker.config.timeout + 1.0,
                                 reply_type=HealthReply)

    async def _probe(self, deadline: float) -> None:
        self._n += 1
        await probe_worker(self.bus, self.pool_name, self.engine_instance, self.role, self._n, deadline)

    async def _escalate(self, reason: str) -> None:
        if self.escalate_subject is None:
            log.error("health: %s (no supervisor to escalate to)", reason)
            return
        await rpc.request(self.bus.nc, self.escalate_subject, {"reason": f"health: {reason}",
                                                               "child": self.child_id}, timeout=5.0)
