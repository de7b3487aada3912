"""Live worker sets per model and pool, from the registry buckets.

``WorkerSet`` is the logic (no NATS): it applies registry puts/deletes of ns-instances, ns-models
and ns-loras and answers "which ready workers serve model M in role R". ``watch_registry`` is the
transport: it feeds a WorkerSet from ``bus.registry.Registry.watch()``. Only instances whose status
is "ready" are ever offered: expired (deleted), sleeping and draining ones are not.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.worker.contract import InstanceRecord, ModelCard

log = logging.getLogger(__name__)

GENERATE_KINDS = ("engine", "mocker", "worker")


@dataclass(frozen=True, slots=True)
class Worker:
    instance: str
    model: str
    pool: str
    role: str  # agg | prefill | decode
    subject: str
    block_size: int | None = None
    host: str = ""
    started_at: float = 0.0  # the incarnation: an instance restarted in place keeps its id, not this


@dataclass
class ModelEntry:
    """A served model: its cards by pool (all pools share the tokenizer and context length)."""

    name: str
    cards: dict[str, ModelCard] = field(default_factory=dict)

    @property
    def card(self) -> ModelCard:
        # decode/agg cards first: they define what the client talks to
        for c in self.cards.values():
            if c.role != "prefill":
                return c
        return next(iter(self.cards.values()))

    @property
    def has_prefill_pool(self) -> bool:
        return any(c.role == "prefill" for c in self.cards.values())


class WorkerSet:
    """Registry state → routable workers. Listeners are called after every change."""

    def __init__(self) -> None:
        self._records: dict[str, InstanceRecord] = {}
        self.models: dict[str, ModelEntry] = {}
        self.loras: dict[str, dict[str, Any]] = {}  # lora name → {"model", "instances": set}
        self._lora_keys: dict[str, tuple[str, str]] = {}  # registry key → (lora name, instance)
        self._by_role: dict[tuple[str, str], list[Worker]] = {}
        self.listeners: list[Callable[[], None]] = []

    # --- registry updates ----------------------------------------------------------------------
    def put_instance(self, key: str, value: bytes | InstanceRecord) -> None:
        rec = value if isinstance(value, InstanceRecord) else msgspec.json.decode(value, type=InstanceRecord)
        self._records[key] = rec
        self._rebuild()

    def delete_instance(self, key: str) -> None:
        if self._records.pop(key, None) is not None:
            self._rebuild()

    def put_model(self, key: str, value: bytes | ModelCard) -> None:
        card = value if isinstance(value, ModelCard) else msgspec.json.decode(value, type=ModelCard)
        entry = self.models.setdefault(card.served_model_name, ModelEntry(card.served_model_name))
        entry.cards[card.pool] = card
        self._notify()

    def delete_model(self, key: str) -> None:
        for name, entry in list(self.models.items()):
            for pool in list(entry.cards):
                if f"{name}.{pool}" == key:
                    del entry.cards[pool]
            if not entry.cards:
                del self.models[name]
        self._notify()

    def put_lora(self, key: str, value: bytes | dict[str, Any]) -> None:
        """ns-loras: key ``<worker instance>.<lora_name>``, value a LoraRecord (lora_name, instance, model)."""
        v = value if isinstance(value, dict) else msgspec.json.decode(value)
        name = v.get("lora_name") or key.split(".", 1)[-1]
        inst = v.get("instance") or key.split(".", 1)[0]
        self._lora_keys[key] = (name, inst)
        entry = self.loras.setdefault(name, {"model": v.get("model"), "instances": set()})
        if v.get("model"):
            entry["model"] = v["model"]
        entry["instances"].add(inst)
        self._notify()

    def delete_lora(self, key: str) -> None:
        found = self._lora_keys.pop(key, None)
        if found is None:
            return
        name, inst = found
        entry = self.loras.get(name)
        if entry is not None:
            if not any(v == (name, inst) for v in self._lora_keys.values()):
                entry["instances"].discard(inst)
            if not entry["instances"]:
                del self.loras[name]
        self._notify()

    # --- queries -------------------------------------------------------------------------------
    def workers(self, model: str, role: str) -> list[Worker]:
        return self._by_role.get((model, role), [])

    def serving_workers(self, model: str) -> list[Worker]:
        """The workers a client-facing request goes to: agg, or decode in a disaggregated model."""
        return self.workers(model, "agg") or self.workers(model, "decode")

    def ready_instances(self) -> list[Worker]:
        return [w for ws in self._by_role.values() for w in ws]

    def resolve_model(self, name: str) -> tuple[ModelEntry, str | None] | None:
        """Model name → (base model entry, lora name or None)."""
        entry = self.models.get(name)
        if entry is not None:
            return entry, None
        lora = self.loras.get(name)
        if lora is not None:
            base = lora.get("model")
            if base and base in self.models:
                return self.models[base], name
            if len(self.models) == 1:  # adapter record without a base: the only model
                return next(iter(self.models.values())), name
        return None

    def lora_instances(self, name: str) -> set[str]:
        lora = self.loras.get(name)
        return set(lora["instances"]) if lora else set()

    # --- internals -----------------------------------------------------------------------------
    def _rebuild(self) -> None:
        by_role: dict[tuple[str, str], list[Worker]] = {}
        for rec in self._records.values():
            if rec.status != "ready" or not rec.generate_subject or rec.kind not in GENERATE_KINDS:
                continue
            w = Worker(instance=rec.instance, model=rec.model, pool=rec.pool or rec.role, role=rec.role,
                       subject=rec.generate_subject, block_size=rec.block_size, host=rec.host,
                       started_at=rec.started_at)
            by_role.setdefault((rec.model, rec.role), []).append(w)
        for ws in by_role.values():
            ws.sort(key=lambda w: w.instance)  # stable order for round robin
        self._by_role = by_role
        self._notify()

    def _notify(self) -> None:
        for fn in self.listeners:
            try:
                fn()
            except Exception:
                log.exception("worker-set listener failed")


async def watch_into(updates: AsyncIterator[Any], put: Callable[[str, bytes], None],
                     delete: Callable[[str], None], what: str) -> None:
    """Apply a registry watch stream (``bus.registry.RegistryEvent``: value None = removed/expired)."""
    async for upd in updates:
        key, value = upd.key, upd.value
        try:
            if value is None:
                delete(key)
            else:
                put(key, value)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            log.warning("ignoring malformed %s entry %s: %s", what, key, e)
