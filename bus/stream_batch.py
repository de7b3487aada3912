"""Stream messages that one loop turn produced for one caller travel as one NATS message.

An engine step yields a token for every request it runs, all in the same turn of the worker's
event loop. Sent one NATS message per stream, every token costs a publish at the worker, a route
in nats-server and a message parse at the frontend; sent as one batch per caller connection, those
costs are paid once per step. A stream that keeps up never waits for a batch: whatever the
streams of a responder's connection sent during one loop turn goes out at the start of the next
turn, and a caller with a single message pending gets it as a plain stream message, exactly as
before (``bus.stream``'s protocol).

Rules:
- only a caller that asked for it (request header ``Stream-Batch: 1``: our ``StreamCall``) gets
  batches, on ``<its inbox prefix>.batch``; ``nats req`` and other plain callers get one message per
  chunk;
- a batch carries ``Content-Type: application/msgpack`` and ``Stream-Batch: <n>``; its payload is a
  msgpack array of ``Piece``: the call's token, Seq, the responder's per-stream reply subject (for
  "gone" answers and liveness probes, as a plain message's reply subject), the chunk's bytes, and
  the control/error headers a plain message would have carried;
- a batch's reply subject is the responder's for that caller connection: "no responders" there (the
  caller's process is gone) stops every stream of that caller. A piece whose call is over is
  answered ``Stream-Control: gone`` on its own reply subject, as a plain message is;
- a batch holds at most ``BATCH_BYTES`` of chunk data (far below any server's ``max_payload``); a
  bigger chunk goes alone, as a plain message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionClosedError

from bus import subjects as S

log = logging.getLogger(__name__)

BATCH_BYTES = 256 * 1024


class Piece(msgspec.Struct, array_like=True):
    """One stream message inside a batch (what a plain message says in its subject and headers)."""

    token: str  # the call's token: the last token of its reply subject
    seq: int
    gone: str  # the responder's reply subject of this stream
    data: bytes = b""
    ctl: str | None = None  # Stream-Control: None for a chunk, "hb", "eos"
    headers: dict[str, str] | None = None  # the first message's Instance-Id/Cancel-Subject; an error
    msgpack: bool = True  # the chunk's content type (the caller chose it)


BATCH_DECODER = msgspec.msgpack.Decoder(list[Piece])
_ENCODER = msgspec.msgpack.Encoder()


def plain_headers(p: Piece) -> dict[str, str]:
    """The headers a piece has as a plain stream message."""
    h = {S.SEQ: str(p.seq)}
    if p.ctl is not None:
        h[S.STREAM_CONTROL] = p.ctl
    elif p.headers is None or S.SERVICE_ERROR_CODE not in p.headers:
        h[S.CONTENT_TYPE] = S.CT_MSGPACK if p.msgpack else S.CT_JSON
    if p.headers:
        h.update(p.headers)
    return h


class Outbox:
    """One per responder connection: what its streams send during a loop turn, sent per caller at
    the start of the next turn (``caller_reply(prefix)`` names the batch's reply subject)."""

    def __init__(self, nc: Client, caller_reply: Callable[[str], str]) -> None:
        self._nc = nc
        self._caller_reply = caller_reply
        self._pending: dict[str, list[Piece]] = {}  # caller inbox prefix -> its pieces, in order
        self._flush_task: asyncio.Task[None] | None = None
        self.batches = 0  # batch messages sent (tests and stats)

    def put(self, reply: str, piece: Piece) -> None:
        if self._nc.is_closed:
            raise ConnectionClosedError
        # the reply subject is the caller's inbox prefix plus the piece's token: keep the prefix only
        self._pending.setdefault(reply.rpartition(".")[0], []).append(piece)
        if self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush())

    async def drained(self) -> None:
        """Until what was put so far has been handed to the connection."""
        task = self._flush_task
        if task is not None:
            await asyncio.shield(task)

    async def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        self._flush_task = None
        nc = self._nc
        for prefix, pieces in pending.items():
            try:
                batch: list[Piece] = []
                size = 0
                for piece in pieces:
                    if len(piece.data) > BATCH_BYTES // 2:  # a big chunk goes alone, in its turn
                        await self._send(prefix, batch)
                        await self._send(prefix, [piece])
                        batch, size = [], 0
                        continue
                    if size + len(piece.data) > BATCH_BYTES:
                        await self._send(prefix, batch)
                        batch, size = [], 0
                    batch.append(piece)
                    size += len(piece.data)
                await self._send(prefix, batch)
            except Exception as e:  # noqa: BLE001 - the callers see a gap or a stall and recover
                if not nc.is_closed:
                    log.warning("stream messages to %s not sent: %s: %s", prefix, type(e).__name__, e)

    async def _send(self, prefix: str, batch: list[Piece]) -> None:
        """One piece as the plain stream message it stands for; several as one batch."""
        if not batch:
            return
        if len(batch) == 1:
            await self._nc.publish(prefix + "." + batch[0].token, batch[0].data, reply=batch[0].gone,
                                   headers=plain_headers(batch[0]))
            return
        self.batches += 1
        await self._nc.publish(S.stream_batch_subject(prefix), _ENCODER.encode(batch),
                               reply=self._caller_reply(prefix),
                               headers={S.CONTENT_TYPE: S.CT_MSGPACK, S.STREAM_BATCH: str(len(batch))})
