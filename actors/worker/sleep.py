"""Sleep/wake of a worker, deregister-then-act, as a plain asyncio class (no NATS).

sleep: leave routing (the registry record turns "sleeping") and stop accepting generate → drain
in-flight (bounded) or abort it → ``engine.sleep(level)``. wake: ``engine.wake_up()`` → accept
again → the record turns "ready". Leaving routing *first* is what keeps routers from sending new
work to an engine that is about to pause; the admission gate closes at the same moment for callers
that still use a stale route. The sleeping record stays in the registry (routers skip it), so a
frontend can tell a cold model from a missing one and a waker can find a replica to wake.

Idle auto-sleep (SleepConfig.idle_timeout) sleeps an idle worker, and optionally deepens the sleep
to level 2 after ``deeper_after`` more seconds. Idle means no request (health probes do not count) in
flight and none started or ended for that long. Idle stop (SleepConfig.idle_stop) is the waker's
(actors.planner.wake): it reads the idle time from the load reports and asks the root to remove the
replica, since a worker may not call the supervisors (the shipped roles deny it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from actors.engines.protocol import Engine
from actors.worker.contract import SleepRequest, StatusReply
from bus.tasks import cancel_and_wait
from config.topology import SleepConfig

log = logging.getLogger(__name__)


class SleepHost(Protocol):
    """What the controller needs from the engine service (actors.worker.serving.EngineService)."""

    accepting: bool  # admission gate for generate
    sleeping: bool  # reported by health

    @property
    def engine(self) -> Engine: ...

    def in_flight(self) -> int: ...

    def last_activity(self) -> float: ...  # time.monotonic() of the last generate start or end

    def touch(self) -> None: ...  # count now as activity (a wake: the idle clocks start again)

    async def abort_all(self, reason: str) -> int: ...


Hook = Callable[[], Awaitable[None]]


class SleepController:
    """``register`` makes the instance routable (its record "ready", the generate subjects
    subscribed), ``deregister`` takes it out of routing (record "sleeping", unsubscribed)."""

    def __init__(self, host: SleepHost, *, register: Hook, deregister: Hook,
                 config: SleepConfig | None = None) -> None:
        self.host = host
        self._register, self._deregister = register, deregister
        self.config = config or SleepConfig()
        self.asleep = False
        self.level = 0
        self._lock = asyncio.Lock()
        self._idle_task: asyncio.Task[None] | None = None

    async def sleep(self, req: SleepRequest | None = None) -> StatusReply:
        req = req or SleepRequest(level=self.config.level, drain_timeout=self.config.drain_timeout)
        if req.level < 0 or req.level > 2:
            return StatusReply(status="error", message=f"invalid sleep level {req.level}: use 0, 1 or 2")
        async with self._lock:
            if self.asleep:
                return StatusReply(status="ok", message=f"already asleep (level {self.level})")
            # 1. out of the registry and closed for new generate requests
            self.host.accepting = False
            try:
                await self._deregister()
            except Exception as e:  # noqa: BLE001 - a registry hiccup must not block sleeping
                log.warning("sleep: deregister failed: %s", e)
            # 2. drain (bounded) or abort what is in flight
            aborted = 0
            if req.mode == "abort":
                aborted = await self.host.abort_all("sleep")
            else:
                timeout = req.drain_timeout if req.drain_timeout is not None else self.config.drain_timeout
                deadline = time.monotonic() + max(0.0, timeout)
                while self.host.in_flight() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                if self.host.in_flight():
                    aborted = await self.host.abort_all("sleep")
                    log.warning("sleep: drain timed out after %.1fs, aborted %d", timeout, aborted)
            # 3. only now the engine sleeps
            try:
                await self.host.engine.sleep(req.level)
            except Exception as e:  # noqa: BLE001 - report, and undo the deregistration
                log.error("engine.sleep(%d) failed: %s", req.level, e)
                self.host.accepting = True
                await self._safe_register()
                return StatusReply(status="error", message=f"engine sleep failed: {e}")
            self.asleep, self.level = True, req.level
            self.host.sleeping = True
            msg = f"asleep at level {req.level}"
            if aborted:
                msg += f" ({aborted} in-flight request(s) aborted)"
            log.info("worker %s", msg)
            return StatusReply(status="ok", message=msg)

    async def wake_up(self) -> StatusReply:
        async with self._lock:
            if not self.asleep:
                return StatusReply(status="ok", message="already awake")
            try:
                await self.host.engine.wake_up()
            except Exception as e:  # noqa: BLE001
                log.error("engine.wake_up failed: %s", e)
                return StatusReply(status="error", message=f"engine wake_up failed: {e}")
            self.asleep, self.level = False, 0
            self.host.sleeping = False
            self.host.accepting = True
            self.host.touch()  # woken for traffic: the idle clocks start now, not at the last request
            await self._safe_register()
            log.info("worker awake")
            return StatusReply(status="ok", message="awake")

    async def _safe_register(self) -> None:
        try:
            await self._register()
        except Exception as e:  # noqa: BLE001 - serving works; the registry heartbeat retries
            log.error("re-register failed: %s", e)

    # --- idle auto-sleep -------------------------------------------------------------------------
    def start_idle_watch(self) -> None:
        if self.config.idle_timeout is not None and self._idle_task is None:
            self._idle_task = asyncio.create_task(self._idle_loop(), name="idle-sleep")

    async def stop_idle_watch(self) -> None:
        if self._idle_task is not None:
            await cancel_and_wait([self._idle_task])
            self._idle_task = None

    async def _idle_loop(self) -> None:
        idle_timeout = float(self.config.idle_timeout or 0)
        tick = max(0.05, min(1.0, idle_timeout / 4))
        asleep_since = 0.0
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if not self.asleep:
                idle = now - self.host.last_activity()
                if self.host.in_flight() == 0 and idle >= idle_timeout:
                    log.info("idle for %.1fs: auto-sleep at level %d", idle, self.config.level)
                    await self.sleep(SleepRequest(level=self.config.level,
                                                  drain_timeout=self.config.drain_timeout))
                    asleep_since = time.monotonic()
            elif (self.config.deeper_after is not None and self.level < 2 and asleep_since
                  and now - asleep_since >= self.config.deeper_after):
                async with self._lock:
                    if self.asleep and self.level < 2:
                        try:
                            await self.host.engine.sleep(2)
                            self.level = 2
                            log.info("still idle: sleep deepened to level 2")
                        except Exception as e:  # noqa: BLE001
                            log.warning("deepening sleep failed: %s", e)
                asleep_since = 0.0
