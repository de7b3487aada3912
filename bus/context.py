"""BusContext: what every actor gets — the process's shared connection, JetStream, subjects."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.connection import connect
from bus.registry import Registry
from bus.subjects import Subjects, inbox_prefix
from config.topology import BusConfig


@dataclass
class BusContext:
    nc: Client
    js: JetStreamContext
    subjects: Subjects
    namespace: str
    host: str
    owns_connection: bool = True
    kv_replicas: int = 1  # JetStream replicas of the registry buckets this process may create

    async def close(self) -> None:
        """Drain (flush outgoing, finish callbacks) and close, if this context owns the connection."""
        if self.owns_connection and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # already closing / server gone: close hard
                await self.nc.close()

    def child(self) -> BusContext:
        """Same connection for another actor of this process (one connection per OS process)."""
        return BusContext(self.nc, self.js, self.subjects, self.namespace, self.host, owns_connection=False,
                          kv_replicas=self.kv_replicas)

    def registry(self, bucket: str, ttl: float = 10.0) -> Registry:
        """A registry bucket, created with the deployment's replicas if it does not exist yet."""
        return Registry(self.js, bucket, ttl, self.kv_replicas)


async def open_context(cfg: BusConfig | str, namespace: str, host: str, name: str,
                       kv_replicas: int = 1, inbox_owner: str | None = None) -> BusContext:
    """``inbox_owner``: replies to this process arrive under a prefix of its own (a scoped worker's
    user may read nothing else)."""
    nc = await connect(cfg, name, inbox_prefix=inbox_prefix(namespace, inbox_owner))
    return BusContext(nc=nc, js=nc.jetstream(), subjects=Subjects(namespace), namespace=namespace, host=host,
                      kv_replicas=kv_replicas)
