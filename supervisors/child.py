"""What a supervisor supervises: ChildSpec and the Child protocol.

A child is anything with start/wait/stop: an in-process actor (actors.base.Actor), an OS process
(supervisors.process.ProcessChild), or a nested Supervisor. The supervisor never looks inside.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from bus.errors import FatalError

Restart = Literal["permanent", "transient", "temporary"]


class Escalation(FatalError):
    """A supervisor gave up (restart intensity exceeded) and passes the failure to its parent."""


class Misconfigured(FatalError):
    """A child failed in a way its restart would repeat: its configuration is rejected (an engine
    arg the engine refuses). A supervisor without ``misconfigured_retries`` gives up at once with
    it (a restart in place cannot help; the parent decides); one with it restarts the child that
    many times while the failure stays the same, then stops it and keeps it listed, with the reason."""


class NormalExit(Exception):  # noqa: N818 - an outcome, not an error
    """Raised by ``Child.wait`` for an exit that is normal but has a reason worth reporting (a worker
    whose snapshot was taken). The supervisor treats it as a normal exit and keeps the message as
    the child's ``last_exit_reason``."""


@runtime_checkable
class Child(Protocol):
    name: str

    async def start(self) -> None:
        """Return once the child is up (ready to serve); raise if it cannot start."""

    async def wait(self) -> None:
        """Return (or raise NormalExit) when the child exits normally; raise the reason when it crashes."""

    async def stop(self, timeout: float | None) -> None:
        """Stop gracefully within ``timeout`` seconds; ``None`` means brutal kill at once."""


@dataclass
class ChildSpec:
    """OTP child spec.

    restart: permanent = always restarted; transient = restarted only after an abnormal exit;
    temporary = never restarted. shutdown: seconds allowed for a graceful stop, or "brutal_kill".
    parallel: the child depends on no sibling, so it may start (and restart) concurrently with other
    parallel children, in a task, while the supervisor handles other events (worker processes).
    """

    id: str
    start: Callable[[], Child]
    restart: Restart = "permanent"
    shutdown: float | Literal["brutal_kill"] = 10.0
    meta: dict[str, str] = field(default_factory=dict)
    parallel: bool = False

    @property
    def shutdown_timeout(self) -> float | None:
        return None if self.shutdown == "brutal_kill" else float(self.shutdown)


class LazyChild:
    """A child built at start time by an async ``build`` (e.g. from what a sibling reports over NATS).

    The supervisor calls the ChildSpec's ``start`` factory synchronously; some actors need facts
    that only exist once an earlier child runs (the KV publisher needs the engine's ZMQ endpoints).
    """

    def __init__(self, name: str, build: Callable[[], Awaitable[Child]]) -> None:
        self.name = name
        self._build = build
        self.child: Child | None = None

    async def start(self) -> None:
        self.child = await self._build()
        await self.child.start()

    async def wait(self) -> None:
        assert self.child is not None, "not started"
        await self.child.wait()

    async def stop(self, timeout: float | None) -> None:
        if self.child is not None:
            await self.child.stop(timeout)
