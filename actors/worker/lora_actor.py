"""LoRA manager actor: ``lora.load|unload|list`` on ``ns.worker.<instance>.lora.*``.

load and unload are strict (unknown fields, empty or non-object payloads are a 400); list takes
anything, an empty payload included.

Transport around ``LoraManager``: it reaches the engine through the engine actor's internal
``engine.lora_add|lora_remove`` endpoints (actors talk only over NATS) and records adapters in the
``ns-loras`` bucket. Records are refreshed while the manager runs and are *not* deleted when it
stops: a manager restarted together with its engine (rest_for_one) finds them and re-applies them;
if the whole worker is gone they expire with the bucket's TTL.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from actors.base import Actor, Endpoint
from actors.worker import contract as C
from actors.worker.contract import (
    EngineLoraAdd,
    EngineLoraRemove,
    LoraInfo,
    LoraLoadRequest,
    LoraRecord,
    LoraUnloadRequest,
    StatusReply,
)
from actors.worker.lora_manager import LoraManager
from actors.worker.lora_source import FetchPolicy
from bus import rpc
from bus.context import BusContext
from bus.errors import RemoteError
from bus.registry import Registry
from config.paths import vllm_actors_home
from config.topology import LoraConfig
from supervisors.child import ChildSpec

if TYPE_CHECKING:
    from actors.worker.process import WorkerEnv

log = logging.getLogger(__name__)

# Engine calls may load weights from disk: give them time.
ENGINE_CALL_TIMEOUT = 120.0
LORA_RECORD_TTL = 60.0


class _EngineOverNats:
    def __init__(self, bus: BusContext, worker: str) -> None:
        self.bus, self.worker = bus, worker

    async def _call(self, verb: str, payload: msgspec.Struct) -> None:
        reply = await rpc.request(self.bus.nc, self.bus.subjects.worker(self.worker, verb), payload,
                                  timeout=ENGINE_CALL_TIMEOUT, reply_type=StatusReply)
        if reply.status != "ok":
            raise RemoteError(f"engine refused: {reply.message}", 500)

    async def add(self, name: str, lora_id: int, path: str) -> None:
        await self._call(C.ENGINE_LORA_ADD, EngineLoraAdd(lora_name=name, lora_id=lora_id, path=path))

    async def remove(self, name: str) -> None:
        await self._call(C.ENGINE_LORA_REMOVE, EngineLoraRemove(lora_name=name))


class _RegistryStore:
    def __init__(self, actor: LoraActor) -> None:
        self.actor = actor
        self.registry: Registry | None = None

    def _key(self, name: str) -> str:
        return f"{self.actor.worker_instance}.{name}"

    async def open(self) -> None:
        self.registry = self.actor.bus.registry(self.actor.bus.subjects.bucket_loras, LORA_RECORD_TTL)
        await self.registry.ensure()

    async def put(self, info: LoraInfo) -> None:
        a = self.actor
        assert self.registry is not None
        rec = LoraRecord(lora_name=info.lora_name, lora_id=info.lora_id, path=info.path, uri=info.uri,
                         instance=a.worker_instance, model=a.model, pool=a.pool_name, host=a.bus.host)
        await self.registry.register(self._key(info.lora_name), rec)

    async def delete(self, name: str) -> None:
        assert self.registry is not None
        await self.registry.deregister(self._key(name))

    async def load_all(self) -> list[LoraInfo]:
        assert self.registry is not None
        prefix = f"{self.actor.worker_instance}."
        out = []
        for key, raw in (await self.registry.items()).items():
            if key.startswith(prefix):
                try:
                    rec = msgspec.json.decode(raw, type=LoraRecord)
                except msgspec.DecodeError:
                    log.warning("ignoring malformed ns-loras record %s", key)
                    continue
                out.append(LoraInfo(lora_name=rec.lora_name, lora_id=rec.lora_id, path=rec.path, uri=rec.uri))
        return out

    async def close(self) -> None:
        if self.registry is not None:
            await self.registry.close()


class LoraActor(Actor):
    kind = "lora"
    description = "LoRA adapter manager of one worker: load, unload, list"

    def __init__(self, bus: BusContext, *, worker_instance: str, pool_name: str, model: str,
                 role: str, config: LoraConfig, max_loras: int, cache_dir: str) -> None:
        super().__init__(bus, instance=f"{worker_instance}-lora", role=role, model=model)
        self.worker_instance = worker_instance
        self.pool_name = pool_name
        self._store = _RegistryStore(self)
        self.manager = LoraManager(_EngineOverNats(bus, worker_instance), self._store,
                                   roots=config.roots, cache_dir=config.cache_dir or cache_dir,
                                   max_loras=max_loras, fetch=fetch_policy(config, pool_name))

    def endpoints(self) -> list[Endpoint]:
        w = lambda verb: self.bus.subjects.worker(self.worker_instance, verb)  # noqa: E731
        return [
            Endpoint("lora_load", w("lora.load"), self.load, LoraLoadRequest, queue_group=None, allow_empty=False),
            Endpoint("lora_unload", w("lora.unload"), self.unload, LoraUnloadRequest, queue_group=None,
                     allow_empty=False),
            Endpoint("lora_list", w("lora.list"), self.list, queue_group=None, bounded=False),
        ]

    def record(self) -> dict[str, Any]:
        rec = dict(super().record())
        rec["worker"] = self.worker_instance
        return rec

    def statistics(self) -> dict[str, Any]:
        return {"loaded": len(self.manager.list()), "max_loras": self.manager.max_loras}

    async def on_start(self) -> None:
        await self._store.open()
        await self.manager.reapply()

    async def on_stop(self) -> None:
        await self._store.close()

    async def load(self, req: LoraLoadRequest, _h: Mapping[str, str]) -> dict[str, Any]:
        info, new = await self.manager.load(req.lora_name, req.source.uri)
        return {"status": "ok", "message": f"adapter {info.lora_name} {'loaded' if new else 'already loaded'}",
                "lora_name": info.lora_name, "lora_id": info.lora_id, "instance": self.worker_instance}

    async def unload(self, req: LoraUnloadRequest, _h: Mapping[str, str]) -> dict[str, Any]:
        info = await self.manager.unload(req.lora_name)
        return {"status": "ok", "message": f"adapter {info.lora_name} unloaded", "lora_name": info.lora_name,
                "instance": self.worker_instance}

    async def list(self, _req: Any, _h: Mapping[str, str]) -> dict[str, Any]:
        return {"instance": self.worker_instance,
                "adapters": [msgspec.to_builtins(i) for i in self.manager.list()]}


def fetch_policy(config: LoraConfig, pool_name: str) -> FetchPolicy:
    """The pool's ``lora.allow_urls`` and download caps, as the adapter downloader applies them."""
    return FetchPolicy(allow_urls=tuple(config.allow_urls), max_bytes=config.max_download_bytes,
                       timeout=config.download_timeout, pool=pool_name)


def worker_child(env: WorkerEnv) -> ChildSpec | None:
    """The worker's LoRA manager, when the engine has LoRA enabled."""
    args = env.pool.engine_args
    if not args.get("enable_lora"):
        return None
    model = env.topology.model.name if env.topology.model else ""
    cache_dir = str(vllm_actors_home() / "loras")

    def make() -> LoraActor:
        return LoraActor(env.ctx.child(), worker_instance=env.instance, pool_name=env.pool_name, model=model,
                         role=env.pool.role, config=env.pool.lora, max_loras=int(args.get("max_loras", 1)),
                         cache_dir=cache_dir)

    return ChildSpec("lora", make, "permanent", 5.0)
