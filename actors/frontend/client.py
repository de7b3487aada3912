"""The worker client: generate streams to worker instances, msgpack over ``bus.stream``, and the
liveness questions the flow asks after a failed attempt.

Closing a StreamCall early (stop string, client gone, task cancelled) publishes a cancel to the
worker, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from actors.worker import contract as C
from actors.worker.contract import (
    CancelRequest,
    EmbedReply,
    EmbedRequest,
    EncodeReply,
    EncodeRequest,
    GenerateChunk,
    GenerateRequest,
)
from bus import rpc
from bus.connection import settling, wait_connected
from bus.context import BusContext
from bus.errors import Unavailable
from bus.stream import StreamCall, stream_request

from .discovery import Worker
from .worker_link import Liveness

log = logging.getLogger(__name__)


async def ask(bus: BusContext, instance: str, timeout: float) -> Liveness:
    """One question to an instance's ``stats`` verb. "No responders" (NATS answers it at once when
    nobody subscribes) is a verdict only once this process's bus has settled after a reconnect; a
    timeout never is."""
    try:
        await rpc.request(bus.nc, bus.subjects.worker(instance, C.VERB_STATS), {}, timeout=timeout)
        return Liveness.ALIVE
    except Unavailable:
        return Liveness.UNKNOWN if settling(bus.nc) else Liveness.DEAD
    except Exception as e:  # noqa: BLE001 - busy, or reconnecting: no verdict
        log.debug("asking %s: %s", instance, e)
        return Liveness.UNKNOWN


class WorkerClient:
    """The bus side of ``completion_flow.WorkerLink``."""

    def __init__(self, bus: BusContext, stall_timeout: float = 10.0, probe_timeout: float = 1.0) -> None:
        self.bus = bus
        self.stall_timeout = stall_timeout
        self.probe_timeout = probe_timeout

    def stream(self, worker: Worker, req: GenerateRequest, headers: dict[str, str] | None = None) -> StreamCall:
        return stream_request(self.bus.nc, worker.subject, req, stall_timeout=self.stall_timeout,
                              msgpack=True, chunk_type=GenerateChunk, headers=headers)

    async def encode(self, worker: Worker, req: EncodeRequest) -> EncodeReply:
        """An encode worker's outputs for a prompt's images (E/P/D); a unary request bounded by the
        stall timeout (the encoder's run is one engine step)."""
        reply: EncodeReply = await rpc.request(
            self.bus.nc, self.bus.subjects.worker(worker.instance, C.VERB_ENCODE), req,
            timeout=self.stall_timeout, msgpack=True, reply_type=EncodeReply)
        return reply

    async def embed(self, worker: Worker, req: EmbedRequest) -> EmbedReply:
        """An embedding worker's embedding of one prompt; a unary request bounded by the stall
        timeout (a prompt's pooling is one engine step, plus its wait in the engine's queue)."""
        reply: EmbedReply = await rpc.request(
            self.bus.nc, self.bus.subjects.worker(worker.instance, C.VERB_EMBED), req,
            timeout=self.stall_timeout, msgpack=True, reply_type=EmbedReply)
        return reply

    async def cancel(self, worker: Worker, request_id: str) -> None:
        """Tell ``worker`` to abort ``request_id`` (a unary request whose caller left); best
        effort, no answer awaited: the worker aborts it if it still runs."""
        try:
            await self.bus.nc.publish(self.bus.subjects.worker_cancel(worker.instance),
                                      msgspec.json.encode(CancelRequest(request_id=request_id)))
        except Exception as e:  # noqa: BLE001 - the bus is down: the worker finishes it unheard
            log.debug("cancel of %s on %s not sent: %s", request_id, worker.instance, e)

    async def connected(self) -> bool:
        """Whether this process is on the bus, waiting (at most a stall timeout) for a reconnect in
        progress: a request issued during a bus restart goes out once the connection is back."""
        return await wait_connected(self.bus.nc, self.stall_timeout)

    async def liveness(self, worker: Worker) -> Liveness:
        """Is ``worker``'s process still on the bus? Asked after an attempt failed, to tell a worker
        that died from a stream the bus lost. Right after a bus restart the worker may not have
        reconnected yet: "no responders" is then asked again until the bus has settled."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.stall_timeout
        while True:
            if not await wait_connected(self.bus.nc, max(0.0, end - loop.time())):
                return Liveness.UNKNOWN
            verdict = await ask(self.bus, worker.instance, self.probe_timeout)
            if verdict is not Liveness.UNKNOWN or not settling(self.bus.nc) or loop.time() >= end:
                return verdict
            await asyncio.sleep(0.2)
