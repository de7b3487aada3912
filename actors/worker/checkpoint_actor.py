"""Checkpoint actor: runs ``CheckpointFlow`` beside the engine actor, over NATS.

Sleep and wake go through the engine actor's own ``sleep``/``wake_up`` endpoints, so they keep the
deregister-then-act order (the instance leaves ns-instances before the engine pauses and returns
after it wakes). When the snapshotter reports ``snapshot-complete`` the worker process has done its
job: ``on_snapshot`` asks it to exit 0. ``status`` tells an operator where the flow stands.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from actors.base import Actor, Endpoint
from actors.worker import contract as C
from actors.worker.checkpoint import RESTORE_DONE, CheckpointFlow
from actors.worker.contract import SleepRequest, StatusReply
from bus import rpc
from bus.context import BusContext
from bus.errors import RemoteError
from supervisors.child import ChildSpec
from supervisors.topology import CheckpointConfig

if TYPE_CHECKING:
    from actors.worker.process import WorkerEnv

log = logging.getLogger(__name__)


class CheckpointActor(Actor):
    kind = "checkpoint"
    description = "Checkpoint/restore coordinator of one worker (snapshot control directory)"

    def __init__(self, bus: BusContext, *, worker_instance: str, role: str, model: str,
                 config: CheckpointConfig, on_snapshot: Callable[[], None]) -> None:
        super().__init__(bus, instance=f"{worker_instance}-checkpoint", role=role, model=model)
        assert config.control_dir, "checkpoint actor needs checkpoint.control_dir"
        self.worker_instance = worker_instance
        self._on_snapshot = on_snapshot
        self.flow = CheckpointFlow(config.control_dir, sleep=self._sleep, wake=self._wake,
                                   poll_interval=config.poll_interval)
        self._task: asyncio.Task[None] | None = None

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint("status", self.bus.subjects.worker(self.worker_instance, "checkpoint.status"),
                         self.status, queue_group=None, bounded=False)]

    def statistics(self) -> dict[str, Any]:
        return {"state": self.flow.state, "control_dir": str(self.flow.dir)}

    async def status(self, _req: Any, _h: Mapping[str, str]) -> dict[str, Any]:
        return self.statistics()

    async def _call(self, verb: str, payload: Any) -> None:
        reply = await rpc.request(self.bus.nc, self.bus.subjects.worker(self.worker_instance, verb), payload,
                                  timeout=120.0, reply_type=StatusReply)
        if reply.status != "ok":
            raise RemoteError(f"{verb} refused: {reply.message}", 500)

    async def _sleep(self) -> None:
        await self._call(C.VERB_SLEEP, SleepRequest(level=1, mode="abort"))

    async def _wake(self) -> None:
        await self._call(C.VERB_WAKE_UP, {})

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.instance}-flow")

    async def on_stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        try:
            outcome = await self.flow.run()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the flow cannot go on: let the supervisor decide
            self.fail(e)
            return
        if outcome != RESTORE_DONE:
            self._on_snapshot()


def worker_child(env: WorkerEnv) -> ChildSpec | None:
    """The checkpoint coordinator, when the pool names a snapshot control directory."""
    cfg = env.pool.checkpoint
    if not cfg.control_dir:
        return None
    model = env.topology.model.name if env.topology.model else ""

    def make() -> CheckpointActor:
        # snapshot-complete: this process has served its purpose; stop it cleanly (exit 0).
        return CheckpointActor(env.ctx.child(), worker_instance=env.instance, role=env.pool.role, model=model,
                               config=cfg, on_snapshot=lambda: os.kill(os.getpid(), signal.SIGTERM))

    # transient: a finished flow is a normal exit; a failed one is restarted.
    return ChildSpec("checkpoint", make, "transient", 5.0)
