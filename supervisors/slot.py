"""The supervisor's bookkeeping for one child: state, generation, backoff attempt, restart count,
and the view operators get (``children``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from supervisors.child import Child, ChildSpec


def describe(exc: BaseException | None) -> str:
    if exc is None:
        return "normal"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(eq=False)
class Slot:
    spec: ChildSpec
    state: str = "stopped"  # starting | running | restarting (waiting out its backoff) | stopped
    child: Child | None = None
    monitor: asyncio.Task[None] | None = None
    gen: int = 0  # bumps on every start; exit events of an older generation are stale
    deadline: float = 0.0  # monotonic time the next start is due (state restarting)
    attempt: int = 0  # consecutive crashes, drives the backoff
    restarts: int = 0
    started_at: float | None = None  # wall clock, for operators
    started_mono: float | None = None
    last_exit_reason: str | None = None
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    # added by ``spawn`` and never up yet: a failed first start discards it (OTP's start_child)
    spawning: bool = False
    # the same Misconfigured failure in a row (``same_as``: its reason, numbers masked); reset once up
    misconfigured: int = 0
    same_as: str | None = None

    def view(self) -> dict[str, Any]:
        """What ``Supervisor.children()`` reports for this child (nested supervisors included)."""
        pid = getattr(self.child, "pid", None) if self.child is not None else None
        nested = getattr(self.child, "children", None)
        status = getattr(self.child, "status", None) if self.child is not None else None
        return {"id": self.spec.id, "state": self.state, "restart": self.spec.restart,
                "restarts": self.restarts, "pid": pid, "started_at": self.started_at,
                "last_exit_reason": self.last_exit_reason,
                **({"meta": self.spec.meta} if self.spec.meta else {}),
                **({"status": status} if isinstance(status, str) and status else {}),
                **({"children": nested()} if callable(nested) else {})}

    def resolve(self, exc: BaseException | None) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_result(None) if exc is None else w.set_exception(exc)
        self.waiters.clear()


def giveup_timeout(slots: list[Slot]) -> float:
    return sum(s.spec.shutdown_timeout or 0.0 for s in slots) + 1.0
