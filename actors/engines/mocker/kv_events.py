"""KV-cache events in exactly vLLM's ZMQ wire format, without importing vLLM (an 11 s import).

The event Structs (from ``actors.engines.kv_events``) are field-for-field copies of
``vllm.distributed.kv_events`` (vllm 0.32): same class names (msgspec uses the class name as the
tag value under the ``"type"`` key), same field names and order, ``omit_defaults`` on events,
``array_like`` batches. A subscriber decoding
with vLLM's own ``KVEventBatch`` cannot tell the mocker from vLLM (tests check this).

Transport, also as vLLM's ``ZmqEventPublisher``:
- PUB socket, one multipart message per engine step that had events:
  ``[topic, seq (8-byte big-endian, from 0), msgpack(KVEventBatch)]``;
- ROUTER replay socket: a DEALER sends ``[b"", start_seq (8B big-endian)]`` and receives every
  buffered ``[b"", topic, seq, payload]`` with seq >= start_seq, then the end marker
  ``[b"", b"", (-1 as 8B signed big-endian), b""]``. The buffer is a ring of ``buffer_steps`` batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from actors.engines.kv_events import DEFAULT_TOPIC, REPLAY_END_SEQ, KVEventBatch, VllmKvEvent, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = REPLAY_END_SEQ.to_bytes(8, "big", signed=True)  # the replay end marker's seq frame


class ZmqKvEventPublisher:
    """PUB + ROUTER-replay publisher for one DP rank, living on the engine's event loop.

    Publishing is a non-blocking send from the loop (PUB drops at the high-water mark, as in
    vLLM); the replay ROUTER is served by a small asyncio task.
    """

    def __init__(self, dp_rank: int, pub_port: int = 0, replay_port: int = 0,
                 host: str = "127.0.0.1", topic: str = DEFAULT_TOPIC,
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        self.dp_rank = dp_rank
        self.topic = topic
        self._topic_bytes = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = self._actx.socket(zmq.ROUTER)
        try:
            self.port = self._bind(self._pub, host, pub_port)
            self.replay_port = self._bind(self._replay, host, replay_port)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = f"tcp://{host}:{self.port}"
        self.replay_endpoint = f"tcp://{host}:{self.replay_port}"
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        logger.info("KV events rank %d: PUB %s, replay %s", dp_rank, self.endpoint,
                    self.replay_endpoint)

    @staticmethod
    def _bind(sock: zmq.Socket, host: str, port: int) -> int:
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{host}")

    def start(self) -> None:
        """Start serving replay requests (needs a running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name=f"mocker-kv-replay-{self.dp_rank}")

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[VllmKvEvent]) -> None:
        """Send one batch (one engine step). Empty lists send nothing, like vLLM."""
        if not events or self._closed:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)
        payload = encode_batch(batch)  # the module the KV publisher decodes with: no drift
        seq = self._seq
        self._seq += 1
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("invalid KV replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        (client, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._closed = True
        if getattr(self, "_task", None) is not None:
            self._task.cancel()
            self._task = None
        for sock in (getattr(self, "_pub", None), getattr(self, "_replay", None)):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
