"""OTP-style supervisor: restart strategies, intensity/period, backoff, escalation.

A Supervisor is itself a Child (start/wait/stop), so trees nest: when a supervisor gives up, its
``wait()`` raises ``Escalation`` and its parent treats that like any other crash.

All state changes happen in one loop task (``_run``): child exits and operator commands are queued
events (supervisors/mailbox.py) handled one at a time, so strategies never race with each other.
Starting a non-parallel child blocks the loop (as in OTP, a supervisor starts one child at a time
and in order). Children whose spec says ``parallel`` (worker processes) start in tasks, at most
``start_concurrency`` at once, and post their outcome to the loop (supervisors/starter.py). Backoff
never blocks the loop: a child waiting out its backoff is a slot with a deadline, and other events
are handled meanwhile. What a crash leads to is the restart policy's call (supervisors/policy.py);
stopping children on purpose is supervisors/stopping.py.

A ``Misconfigured`` failure (the child's configuration is rejected: its restart would fail the same
way) is not restarted in place forever: a supervisor gives up at once with it, so its parent
decides, unless it has ``misconfigured_retries`` (a host's root): then the child is restarted that
many times while the failure stays the same, and then stopped and kept, with the reason in its
``last_exit_reason``, while its siblings go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from bus.backoff import Backoff
from bus.errors import Conflict, NotFound, Unavailable
from supervisors import metrics
from supervisors.child import Child, ChildSpec, Escalation, Misconfigured, NormalExit
from supervisors.mailbox import Command, Event, Mailbox
from supervisors.policy import RestartPolicy, Strategy
from supervisors.slot import Slot, describe, giveup_timeout
from supervisors.starter import Starter, listen, next_wakeup, plan_starts, progress_line
from supervisors.stopping import kill, stop_all, stop_slot

log = logging.getLogger(__name__)


class Supervisor:
    """Supervises children (in-process actors, OS processes, nested supervisors)."""

    def __init__(self, name: str, children: list[ChildSpec], strategy: Strategy = "one_for_one",
                 intensity: int = 5, period: float = 60.0, backoff: Any = None,
                 on_status: Callable[[str], None] | None = None, start_concurrency: int = 4,
                 misconfigured_retries: int | None = None) -> None:
        ids = [s.id for s in children]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate child ids in supervisor {name}: {ids}")
        if start_concurrency < 1:
            raise ValueError(f"start_concurrency must be >= 1, got {start_concurrency}")
        self.name = name
        self.policy = RestartPolicy(strategy, intensity, period, Backoff.of(backoff))
        self.on_status = on_status
        self.start_concurrency = start_concurrency
        self.misconfigured_retries = misconfigured_retries
        self._slots: list[Slot] = [Slot(spec) for spec in children]
        self._mailbox = Mailbox(name)
        self._loop_task: asyncio.Task[None] | None = None
        self._up: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        self._stopping = False
        self._done = asyncio.Event()
        self._starter = Starter(name, self._mailbox.post, functools.partial(kill, name))
        self._settled = False  # every child up (or stopped) and that has been reported
        metrics.track(self)  # children by state on this process's /metrics

    # --- Child protocol ------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every child in order; return once all are up. A child that fails to start counts
        as a crash (restarted per its spec); raise Escalation when the intensity is exceeded."""
        if self._loop_task is not None:
            raise RuntimeError(f"supervisor {self.name} already started")
        self._up = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        for s in self._slots:
            s.state, s.deadline = "restarting", now
        self._status(f"{self.name}: starting {len(self._slots)} children")
        self._loop_task = asyncio.create_task(self._run(), name=f"supervisor:{self.name}")
        try:
            await asyncio.wait({self._up, self._loop_task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self.stop(None)
            raise
        if not self._up.done():
            # the loop ended: escalation (it has stopped the children) or a concurrent stop()
            await self._done.wait()
            raise self._failure or Unavailable(f"supervisor {self.name} stopped while starting")

    async def wait(self) -> None:
        await self._done.wait()
        if self._failure is not None:
            raise self._failure

    async def stop(self, timeout: float | None = None) -> None:
        """Stop children in reverse start order, each within its spec's shutdown timeout (and the
        whole within ``timeout``; ``None`` kills everything at once)."""
        if self._stopping:
            await self._done.wait()
            return
        self._stopping = True
        self._status(f"{self.name}: stopping")
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await stop_all(self.name, self._starter, self._slots, timeout)
        self._finish()

    # --- runtime API (operators, planner, service.py) -------------------------------------------
    def children(self) -> list[dict[str, Any]]:
        return [slot.view() for slot in self._slots]

    def child(self, child_id: str) -> dict[str, Any]:
        """One entry of children(); NotFound when there is no such child."""
        self._find(child_id)
        return next(c for c in self.children() if c["id"] == child_id)

    @property
    def running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def restart_child(self, child_id: str) -> None:
        """Operator restart: stop the child (and, per strategy, its dependants) and start it again
        at once. Not counted against the intensity. Returns once it and its restarted dependants
        are running again (raises the first start error otherwise)."""
        waiters = await self._call(lambda: self._cmd_restart(child_id))
        results = await asyncio.gather(*waiters, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def spawn(self, spec: ChildSpec) -> None:
        """Add a child at the end of the start order and start it; return once it is up. If its
        first start fails the child is discarded and the start error raised, as OTP's
        ``start_child`` does: a spawn that cannot start (a planner growing a broken pool) must
        not become a child restarted forever and counted against the restart intensity."""
        waiter = await self._call(lambda: self._cmd_spawn(spec))
        await waiter

    async def stop_child(self, child_id: str, remove: bool = False) -> None:
        """Terminate a child; it stays listed as stopped (restart_child revives it) unless
        ``remove`` or the child is temporary."""
        await self._call(lambda: self._cmd_stop(child_id, remove))

    async def escalate(self, reason: str, child: str | None = None) -> None:
        """With ``child``: treat it as crashed (restarted per strategy, counted, with backoff).
        Without: this supervisor gives up and fails to its parent. Returns once queued, so that a
        child may call it even when the handling will stop that very child."""
        if not self.running:
            raise Unavailable(f"supervisor {self.name} is not running")
        if child is not None:
            self._find(child)
        self._mailbox.post(("escalate", child, reason))

    # --- the loop --------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while self._failure is None:
                while self._failure is None and not self._stopping and (ev := self._mailbox.take()) is not None:
                    await self._handle(ev)
                if self._stopping:
                    # stop() cancelled this loop, and the cancellation was lost on its way (Python
                    # 3.11's asyncio.wait_for returns an inner await's result that completes as the
                    # cancel arrives; a child's start may run such code): end here, or the loop
                    # waits for its next event for good (a root stopped while its in-process actors
                    # started hung). stop() stops the children
                    return
                if self._failure is not None:
                    break
                now = time.monotonic()
                parallel, due = plan_starts(self._slots, now, self._starter.in_flight,
                                            self.start_concurrency)
                for s in parallel:
                    self._starter.begin(s, lambda child, s=s: listen(child, lambda _: self._refresh(s)))
                if parallel:
                    self._progress()
                if due is not None:
                    await self._start_slot(due)
                    continue
                if self._stopping:
                    return  # as above: a start that swallowed stop()'s cancellation has returned
                self._settle()
                timeout = next_wakeup(self._slots, now)
                if (ev := await self._mailbox.next(timeout)) is not None:
                    await self._handle(ev)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave children unsupervised silently
            log.exception("supervisor %s: internal error", self.name)
            self._failure = Escalation(f"supervisor {self.name} internal error: {describe(e)}")
        # gave up: stop everything and fail to the parent
        log.error("supervisor %s gives up: %s", self.name, self._failure)
        self._status(f"{self.name}: failed: {self._failure}")
        await stop_all(self.name, self._starter, self._slots,
                       None if self._stopping else giveup_timeout(self._slots))
        self._finish()

    async def _handle(self, ev: Event) -> None:
        kind = ev[0]
        if kind == "exit":
            _, slot, gen, exc = ev
            if slot.gen != gen or slot.state != "running" or slot not in self._slots:
                return  # stale: the child was stopped or restarted meanwhile
            slot.child, slot.monitor = None, None
            await self._crashed(slot, exc)
        elif kind == "started":
            _, slot, gen, child, exc = ev
            if slot.gen != gen or slot.state != "starting" or slot not in self._slots:
                return  # stale: stopped meanwhile, and _stop_slot took care of the child
            self._starter.finished(slot)
            if child is None:
                log.warning("supervisor %s: child %s failed to start: %s", self.name, slot.spec.id,
                            describe(exc))
                slot.started_mono = None
                await self._crashed(slot, exc)
            else:
                self._mark_up(slot, child)
                if any(s.state == "starting" for s in self._slots):
                    self._progress()
        elif kind == "escalate":
            _, child_id, reason = ev
            if child_id is None:
                self._failure = Escalation(f"supervisor {self.name}: escalated: {reason}")
                return
            slot = next((s for s in self._slots if s.spec.id == child_id), None)
            if slot is None or slot.state != "running":
                log.warning("supervisor %s: escalate for %s ignored (not running)", self.name, child_id)
                return
            log.warning("supervisor %s: %s escalated: %s", self.name, child_id, reason)
            await stop_slot(self.name, self._starter, slot)
            await self._crashed(slot, Escalation(reason), label="escalated")
        elif kind == "cmd":
            _, fn, fut = ev
            await self._mailbox.run(fn, fut)

    async def _call(self, fn: Command) -> Any:
        if not self.running:
            raise Unavailable(f"supervisor {self.name} is not running")
        return await self._mailbox.call(fn)

    # --- crash handling --------------------------------------------------------------------------
    async def _crashed(self, slot: Slot, exc: BaseException | None, label: str | None = None) -> None:
        """``slot``'s child is gone (exited, crashed, failed to start or was escalated). ``label``:
        the restart's reason on /metrics when the exception's own would mislead."""
        reason = describe(exc)
        if isinstance(exc, NormalExit):  # a normal exit that says why (e.g. "snapshot complete")
            reason, exc = str(exc), None
        slot.last_exit_reason = reason
        spec = slot.spec
        slot.resolve(exc or Unavailable(f"child {spec.id} exited"))
        if slot.spawning:
            log.warning("supervisor %s: spawned child %s failed to start (%s): discarded, not restarted",
                        self.name, spec.id, reason)
            self._slots.remove(slot)
            return
        if self._misconfigured(slot, exc, reason):
            return
        if spec.restart == "temporary" or (spec.restart == "transient" and exc is None):
            log.info("supervisor %s: child %s exited (%s), %s: not restarted",
                     self.name, spec.id, reason, spec.restart)
            slot.state = "stopped"
            if spec.restart == "temporary":
                self._slots.remove(slot)
            return
        now = time.monotonic()
        policy = self.policy
        if policy.exceeded(now):
            slot.state = "stopped"
            self._failure = Escalation(
                f"supervisor {self.name}: more than {policy.intensity} restarts in {policy.period:g}s; "
                f"last: child {spec.id}: {reason}")
            return
        delay = policy.next_delay(slot, now)
        group = policy.group(self._slots, slot)
        log.warning("supervisor %s: child %s %s (%s); restarting %s in %.2fs (%s)", self.name,
                    spec.id, "exited" if exc is None else "crashed", reason,
                    ", ".join(s.spec.id for s in group), delay, policy.strategy)
        self._status(f"{self.name}: restarting {spec.id} in {delay:.1f}s: {reason}")
        for s in reversed(group):
            if s is not slot and (s.child is not None or self._starter.busy(s)):
                await stop_slot(self.name, self._starter, s)
                s.last_exit_reason = f"shutdown: {policy.strategy} after {spec.id} {reason}"
        for s in group:
            if s is not slot and s.spec.restart == "temporary":
                s.state = "stopped"
                self._slots.remove(s)
                continue
            s.state, s.deadline = "restarting", now + delay
            s.restarts += 1
            metrics.restarted(self.name, s.spec.id, (label or metrics.reason_label(exc)) if s is slot
                              else policy.strategy)

    def _misconfigured(self, slot: Slot, exc: BaseException | None, reason: str) -> bool:
        """Handle a Misconfigured failure: True when it ends here (this supervisor gives up, or the
        child is stopped for good); False to restart it as any crash."""
        if not isinstance(exc, Misconfigured):
            slot.misconfigured, slot.same_as = 0, None
            return False
        spec = slot.spec
        if self.misconfigured_retries is None:
            slot.state = "stopped"
            self._failure = Misconfigured(f"child {spec.id}: {exc}")
            return True
        same = _masked(reason)
        slot.misconfigured = slot.misconfigured + 1 if same == slot.same_as else 1
        slot.same_as = same
        if slot.misconfigured <= self.misconfigured_retries:
            return False
        slot.state = "stopped"
        slot.last_exit_reason = f"stopped after the same configuration error {slot.misconfigured} times: {reason}"
        log.error("supervisor %s: child %s %s; not restarted (restart_child starts it again)",
                  self.name, spec.id, slot.last_exit_reason)
        self._status(f"{self.name}: {spec.id} stopped: configuration rejected")
        return True

    # --- starting and stopping one child ---------------------------------------------------------
    async def _start_slot(self, slot: Slot) -> None:
        spec = slot.spec
        slot.state = "starting"
        self._status(f"{self.name}: starting {spec.id}")
        child: Child | None = None
        try:
            child = spec.start()
            slot.child = child
            listen(child, lambda _: self._refresh(slot))
            await child.start()
        except asyncio.CancelledError:
            if child is not None:
                await kill(self.name, child)
            slot.child, slot.state = None, "restarting"
            raise
        except Exception as e:
            log.warning("supervisor %s: child %s failed to start: %s", self.name, spec.id, describe(e))
            if child is not None:
                await kill(self.name, child)  # a half-started child must not linger
            slot.child, slot.started_mono = None, None
            await self._crashed(slot, e)
            return
        self._mark_up(slot, child)

    def _mark_up(self, slot: Slot, child: Child) -> None:
        spec = slot.spec
        slot.child = child
        slot.spawning = False
        slot.misconfigured, slot.same_as = 0, None
        slot.gen += 1
        slot.state = "running"
        slot.started_at, slot.started_mono = time.time(), time.monotonic()
        slot.monitor = asyncio.create_task(self._watch(slot, slot.gen, child),
                                           name=f"watch:{self.name}/{spec.id}")
        log.info("supervisor %s: child %s up%s", self.name, spec.id,
                 f" (pid {child.pid})" if getattr(child, "pid", None) else "")
        slot.resolve(None)

    async def _watch(self, slot: Slot, gen: int, child: Child) -> None:
        exc: BaseException | None = None
        try:
            await child.wait()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            exc = e
        self._mailbox.post(("exit", slot, gen, exc))

    def _finish(self) -> None:
        self._mailbox.close()
        self._done.set()

    # --- commands (run inside the loop) ----------------------------------------------------------
    def _find(self, child_id: str) -> Slot:
        for s in self._slots:
            if s.spec.id == child_id:
                return s
        raise NotFound(f"supervisor {self.name} has no child {child_id!r}")

    def _waiter(self, slot: Slot) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        slot.waiters.append(fut)
        return fut

    async def _cmd_restart(self, child_id: str) -> list[asyncio.Future[None]]:
        slot = self._find(child_id)
        group = self.policy.group(self._slots, slot) if slot.state != "stopped" else [slot]
        log.info("supervisor %s: restart of %s requested (%s)", self.name, child_id,
                 ", ".join(s.spec.id for s in group))
        for s in reversed(group):
            await stop_slot(self.name, self._starter, s)
        now = time.monotonic()
        for s in group:
            s.state, s.deadline, s.attempt = "restarting", now, 0
            s.restarts += 1
            s.last_exit_reason = "restart requested"
            metrics.restarted(self.name, s.spec.id, "requested")
        return [self._waiter(s) for s in group]

    async def _cmd_spawn(self, spec: ChildSpec) -> asyncio.Future[None]:
        if any(s.spec.id == spec.id for s in self._slots):
            raise Conflict(f"supervisor {self.name} already has a child {spec.id!r}")
        slot = Slot(spec, state="restarting", deadline=time.monotonic(), spawning=True)
        self._slots.append(slot)
        log.info("supervisor %s: spawning %s", self.name, spec.id)
        return self._waiter(slot)

    async def _cmd_stop(self, child_id: str, remove: bool) -> None:
        slot = self._find(child_id)
        await stop_slot(self.name, self._starter, slot)
        slot.state = "stopped"
        slot.last_exit_reason = "stopped on request"
        slot.resolve(Unavailable(f"child {child_id} stopped"))
        if remove or slot.spec.restart == "temporary":
            self._slots.remove(slot)
        log.info("supervisor %s: child %s stopped on request%s", self.name, child_id,
                 " and removed" if slot not in self._slots else "")

    def _settle(self) -> None:
        """Once nothing is starting or waiting: report it and let start() return."""
        if any(s.state in ("restarting", "starting") for s in self._slots):
            self._settled = False
            return
        if not self._settled:
            self._settled = True
            up = sum(s.state == "running" for s in self._slots)
            self._status(f"{self.name}: all {up} children up" if up == len(self._slots) else
                         f"{self.name}: {up}/{len(self._slots)} children up, the rest stopped")
        if self._up is not None and not self._up.done():
            self._up.set_result(None)

    def _progress(self) -> None:
        self._status(progress_line(self.name, self._slots))

    def _refresh(self, slot: Slot) -> None:
        """A child reported progress (a STATUS= line): while it starts, the line shows it."""
        if slot.state == "starting" and slot in self._slots:
            self._progress()

    def _status(self, text: str) -> None:
        if self.on_status is not None:
            try:
                self.on_status(text)
            except Exception:
                log.exception("on_status callback failed")


def _masked(reason: str) -> str:
    """A failure's reason with its numbers masked (pids, ports, the hex ids of temporary paths),
    so that the same error met again compares equal."""
    return re.sub(r"0x[0-9a-fA-F]+|[0-9a-f]*\d[0-9a-f]*", "#", reason)
