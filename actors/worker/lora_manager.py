"""LoRA manager logic (no NATS): load/unload/list adapters on one worker's engine.

Rules: one load or unload per adapter name at a time (a per-name aiorwlock writer lock, readers are
the list calls); capacity is ``max_loras`` adapters; loading the same name from the same URI again
is idempotent, from another URI is a conflict; a failed step rolls back the earlier ones (engine
add, downloaded files); every loaded adapter is recorded through ``LoraStore`` (the ``ns-loras``
bucket) so a restarted manager re-applies them to the fresh engine.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from pathlib import Path
from typing import Protocol

import aiorwlock

from actors.worker import lora_source
from actors.worker.contract import LoraInfo
from bus.errors import BadRequest, Conflict, NotFound, Overloaded

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class LoraEngine(Protocol):
    """The engine actor's adapter endpoints, as the manager sees them."""

    async def add(self, name: str, lora_id: int, path: str) -> None: ...

    async def remove(self, name: str) -> None: ...


class LoraStore(Protocol):
    """Where loaded adapters are recorded (this worker's entries of ns-loras)."""

    async def put(self, info: LoraInfo) -> None: ...

    async def delete(self, name: str) -> None: ...

    async def load_all(self) -> list[LoraInfo]: ...


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise BadRequest(f"invalid lora_name {name!r}: letters, digits, '_', '.', '-' (max 128)")
    return name


class LoraManager:
    def __init__(self, engine: LoraEngine, store: LoraStore, *, roots: list[str], cache_dir: str,
                 max_loras: int, fetch: lora_source.FetchPolicy | None = None) -> None:
        self._engine = engine
        self._store = store
        self._roots = roots
        self._cache_dir = cache_dir
        # What http(s) adapters may be downloaded (pools.<pool>.lora.allow_urls and caps); none by default.
        self._fetch = fetch or lora_source.FetchPolicy()
        self.max_loras = max_loras
        self._loaded: dict[str, LoraInfo] = {}
        self._locks: dict[str, aiorwlock.RWLock] = {}
        self._slots = asyncio.Lock()  # guards the capacity check + reservation
        self._reserved: set[str] = set()
        self._next_id = 1

    def _lock(self, name: str) -> aiorwlock.RWLock:
        return self._locks.setdefault(name, aiorwlock.RWLock())

    def _alloc_id(self) -> int:
        used = {i.lora_id for i in self._loaded.values()}
        while self._next_id in used:
            self._next_id += 1
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def list(self) -> list[LoraInfo]:
        return sorted(self._loaded.values(), key=lambda i: i.lora_name)

    def get(self, name: str) -> LoraInfo | None:
        return self._loaded.get(name)

    async def load(self, name: str, uri: str) -> tuple[LoraInfo, bool]:
        """Load ``name`` from ``uri``; returns (info, newly_loaded)."""
        check_name(name)
        async with self._lock(name).writer_lock:
            current = self._loaded.get(name)
            if current is not None:
                if current.uri == uri:
                    return current, False
                raise Conflict(f"adapter {name!r} is already loaded from {current.uri!r}; unload it first")
            async with self._slots:
                if len(self._loaded) + len(self._reserved) >= self.max_loras:
                    raise Overloaded(f"LoRA capacity reached ({self.max_loras} adapters loaded); "
                                     "unload one first")
                self._reserved.add(name)
            try:
                return await self._load_reserved(name, uri), True
            finally:
                self._reserved.discard(name)

    async def _load_reserved(self, name: str, uri: str) -> LoraInfo:
        path, created = await lora_source.resolve(uri, self._roots, self._cache_dir, self._fetch)
        info = LoraInfo(lora_name=name, lora_id=self._alloc_id(), path=str(path), uri=uri)
        added = False
        try:
            await self._engine.add(name, info.lora_id, info.path)
            added = True
            await self._store.put(info)
        except BaseException:
            # Roll back what this load did, newest first; the original error is what the caller sees.
            if added:
                try:
                    await self._engine.remove(name)
                except Exception:
                    log.exception("rollback: removing adapter %s from the engine failed", name)
            if created:
                shutil.rmtree(path, ignore_errors=True)
            raise
        self._loaded[name] = info
        log.info("loaded LoRA adapter %s (id %d) from %s", name, info.lora_id, uri)
        return info

    async def unload(self, name: str) -> LoraInfo:
        check_name(name)
        async with self._lock(name).writer_lock:
            info = self._loaded.get(name)
            if info is None:
                raise NotFound(f"adapter {name!r} is not loaded")
            await self._engine.remove(name)
            del self._loaded[name]
            await self._store.delete(name)
            log.info("unloaded LoRA adapter %s", name)
            return info

    async def reapply(self) -> list[str]:
        """Re-add every recorded adapter to a (re)started engine; drop records that fail."""
        names: list[str] = []
        for info in await self._store.load_all():
            if info.lora_name in self._loaded:
                continue
            try:
                if not Path(info.path).exists():
                    raise NotFound(f"adapter files gone: {info.path}")
                await self._engine.add(info.lora_name, info.lora_id, info.path)
            except Exception as e:
                log.error("re-applying LoRA adapter %s failed (%s); dropping its record", info.lora_name, e)
                await self._store.delete(info.lora_name)
                continue
            self._loaded[info.lora_name] = info
            self._next_id = max(self._next_id, info.lora_id + 1)
            names.append(info.lora_name)
        if names:
            log.info("re-applied LoRA adapters after restart: %s", ", ".join(names))
        return names
