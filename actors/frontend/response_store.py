"""Stored responses of /v1/responses (``store: true``), in the ``<ns>-responses`` JetStream KV bucket.

One entry per response id: the response object (what GET /v1/responses/{id} returns) and the chat
messages it answered, which a follow-up naming it as ``previous_response_id`` continues. On the bus,
not in a process: a follow-up works after a frontend restart and from any frontend process, and
``nats kv ls <ns>-responses`` shows what is kept. The bucket's TTL (``frontend.responses.ttl``)
ages entries out; ``max_bytes`` bounds the bucket and ``max_entry_bytes`` one entry (a conversation
grows with every turn): a response that does not fit is served but not stored, and says so
(``store: false``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from bus.errors import Overloaded
from bus.registry import read_live
from config.topology import ResponsesConfig

log = logging.getLogger(__name__)

# a KV key is [-/_=.a-zA-Z0-9]+; ids are narrower still, so an id from a client can never be a
# wildcard or reach another bucket's subject
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def valid_id(response_id: str) -> bool:
    return _ID.fullmatch(response_id) is not None


class Stored(msgspec.Struct, kw_only=True):
    response: dict[str, Any]
    messages: list[dict[str, Any]]


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Stored)


class StoreUnavailable(Overloaded):
    """The bucket could not be read or changed now (JetStream unavailable): 503, try again."""


@dataclass
class ResponseStore:
    js: JetStreamContext
    bucket: str
    config: ResponsesConfig
    replicas: int = 1

    def __post_init__(self) -> None:
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()

    async def _bucket(self) -> KeyValue:
        """The bucket, created on first use (with the deployment's replicas) when missing."""
        if self._kv is not None:
            return self._kv
        async with self._lock:
            if self._kv is None:
                try:
                    self._kv = await self.js.key_value(self.bucket)
                except nats.js.errors.BucketNotFoundError:
                    cfg = KeyValueConfig(bucket=self.bucket, ttl=self.config.ttl, history=1,
                                         max_bytes=self.config.max_bytes,
                                         max_value_size=self.config.max_entry_bytes,
                                         replicas=self.replicas, description="vllm-actors stored responses")
                    try:
                        self._kv = await self.js.create_key_value(cfg)
                        log.info("created KV bucket %s (ttl %gs, %d bytes)", self.bucket, self.config.ttl,
                                 self.config.max_bytes)
                    except nats.js.errors.BadRequestError:  # created at once by another frontend
                        self._kv = await self.js.key_value(self.bucket)
        return self._kv

    async def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Store one response; False (logged) when it cannot be: too large, bucket full, bus down."""
        data = _enc.encode(Stored(response=response, messages=messages))
        if len(data) > self.config.max_entry_bytes:
            log.warning("response %s not stored: %d bytes, over frontend.responses.max_entry_bytes (%d)",
                        response_id, len(data), self.config.max_entry_bytes)
            return False
        try:
            await (await self._bucket()).put(response_id, data)
            return True
        except (nats.errors.Error, OSError) as e:
            log.warning("response %s not stored in %s: %s", response_id, self.bucket, e)
            return False

    async def get(self, response_id: str) -> Stored | None:
        if not valid_id(response_id):
            return None
        try:
            kv = await self._bucket()
            data = await read_live(self.js, kv, response_id, direct=True)
        except (nats.errors.Error, OSError) as e:
            raise StoreUnavailable(f"stored responses cannot be read now: {e}") from e
        return None if data is None else _dec.decode(data)

    async def delete(self, response_id: str) -> bool:
        """Remove one response; False when there was none."""
        if await self.get(response_id) is None:
            return False
        try:
            await (await self._bucket()).purge(response_id)
        except (nats.errors.Error, OSError) as e:
            raise StoreUnavailable(f"stored responses cannot be changed now: {e}") from e
        return True
