"""Live worker sets per model and pool, from the registry buckets.

``WorkerSet`` is the logic (no NATS): it applies registry puts/deletes of ns-instances, ns-models
and ns-loras and answers "which ready workers serve model M in role R". The transport is the
process's ``actors.instances.watch.BucketWatch`` of each bucket (the frontend subscribes this set to
them). Only instances whose status is "ready" are ever offered: expired (deleted), sleeping and
draining ones are not.

Nothing in the buckets is believed on its own. A bucket can outlive the processes that wrote it (a
deployment SIGKILLed and started again within the TTL, an external NATS), so:

- with ``verify=True`` an instance record is offered only once its instance has answered on the bus
  (``confirm.InstanceConfirmer`` calls ``confirm``; a record whose instance does not answer is a ghost:
  ``delete``);
- model cards and LoRA placements are tied to live instances: ``models`` lists a model only while a
  request for it can be served now (a ready agg worker, or a ready decode worker plus a ready
  prefill worker unless decode-only fallback is allowed for it), and a LoRA only while a ready
  instance holds it. Cards of pools with no live instance are kept but never shown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.instances.contract import InstanceRecord, ModelCard

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Worker:
    instance: str
    model: str
    pool: str
    role: str  # agg | prefill | decode | encode | embed
    subject: str
    block_size: int | None = None
    host: str = ""
    started_at: float = 0.0  # the incarnation: an instance restarted in place keeps its id, not this


@dataclass
class ModelEntry:
    """A served model: the cards of its live pools (all pools share the tokenizer and context
    length)."""

    name: str
    cards: dict[str, ModelCard] = field(default_factory=dict)

    @property
    def card(self) -> ModelCard:
        # decode/agg cards first: they define what the client talks to
        for c in self.cards.values():
            if c.role not in ("prefill", "encode"):
                return c
        return next(iter(self.cards.values()))

    @property
    def has_prefill_pool(self) -> bool:
        return any(c.role == "prefill" for c in self.cards.values())

    @property
    def embeds(self) -> bool:
        """An embedding model: its pools run vLLM's pooling runner (role "embed"), so it serves
        /v1/embeddings and nothing that generates (a topology's pools are all embed, or none)."""
        return any(c.role == "embed" for c in self.cards.values())

    @property
    def has_encode_pool(self) -> bool:
        """E/P/D: a live encode pool runs the vision encoder for this model's image prompts."""
        return any(c.role == "encode" for c in self.cards.values())


class WorkerSet:
    """Registry state → routable workers. Listeners are called after every change.

    ``decode_only(model)`` says whether a disaggregated model may be served by decode workers
    alone (the topology's ``model.allow_decode_only``); without it decode-only is allowed.
    """

    def __init__(self, *, verify: bool = False, decode_only: Callable[[str], bool] | None = None) -> None:
        self.verify = verify
        self.decode_only = decode_only or (lambda _model: True)
        self._records: dict[str, InstanceRecord] = {}
        self._confirmed: set[tuple[str, float]] = set()  # (instance, started_at) that answered
        self._cards: dict[str, ModelCard] = {}  # registry key → card (any pool, live or not)
        # served name → the last card seen for it, kept after its key expires: a cold model (its
        # pools at zero replicas, so nobody refreshes the card) is still listed with it
        self._last_card: dict[str, ModelCard] = {}
        self.models: dict[str, ModelEntry] = {}  # servable now (derived)
        self._lora_keys: dict[str, tuple[str, str]] = {}  # registry key → (lora name, instance)
        self._lora_model: dict[str, str | None] = {}  # lora name → base model
        self.loras: dict[str, dict[str, Any]] = {}  # lora name → {"model", "instances"} (derived: live)
        self._by_role: dict[tuple[str, str], list[Worker]] = {}
        self._pools: dict[str, str] = {}  # worker instance → its pool (any status)
        self.listeners: list[Callable[[], None]] = []

    # --- registry updates ----------------------------------------------------------------------
    def put_instance(self, key: str, rec: InstanceRecord) -> bool:
        """Apply a record; True when its instance still has to be confirmed live (``confirm``)."""
        old = self._records.get(key)
        if old is not None and old.started_at != rec.started_at:
            self._confirmed.discard((old.instance, old.started_at))  # that incarnation is gone
        self._records[key] = rec
        self._rebuild()
        return self.needs_confirmation(key)

    def needs_confirmation(self, key: str) -> bool:
        rec = self._records.get(key)
        return (self.verify and rec is not None and rec.is_worker
                and (rec.instance, rec.started_at) not in self._confirmed)

    def confirm(self, key: str, started_at: float) -> None:
        """The instance of ``key`` (incarnation ``started_at``) answered on the bus."""
        rec = self._records.get(key)
        if rec is not None and rec.started_at == started_at:
            self._confirmed.add((rec.instance, started_at))
            self._rebuild()

    def unconfirm(self, key: str) -> None:
        """The instance of ``key`` stopped answering: not routed (nor counted ready) until it
        answers again."""
        rec = self._records.get(key)
        if rec is not None and (rec.instance, rec.started_at) in self._confirmed:
            self._confirmed.discard((rec.instance, rec.started_at))
            self._rebuild()

    def confirmed_keys(self) -> list[str]:
        return [k for k, r in self._records.items() if (r.instance, r.started_at) in self._confirmed]

    def record(self, key: str) -> InstanceRecord | None:
        return self._records.get(key)

    def delete_instance(self, key: str) -> None:
        rec = self._records.pop(key, None)
        if rec is not None:
            self._confirmed.discard((rec.instance, rec.started_at))
            self._rebuild()

    def put_model(self, key: str, card: ModelCard) -> None:
        self._cards[key] = card
        last = self._last_card.get(card.served_model_name)
        if last is None or card.role not in ("prefill", "encode") or last.role in ("prefill", "encode"):
            self._last_card[card.served_model_name] = card  # decode/agg cards speak for the model
        self._rebuild()

    def last_card(self, name: str) -> ModelCard | None:
        """The last card seen for model ``name``, even once no worker refreshes it."""
        return self._last_card.get(name)

    def delete_model(self, key: str) -> None:
        if self._cards.pop(key, None) is not None:
            self._rebuild()

    def put_lora(self, key: str, v: dict[str, Any]) -> None:
        """ns-loras: key ``<worker instance>.<lora_name>``, value a LoraRecord (lora_name, instance, model)."""
        name = v.get("lora_name") or key.split(".", 1)[-1]
        inst = v.get("instance") or key.split(".", 1)[0]
        self._lora_keys[key] = (name, inst)
        if v.get("model") or name not in self._lora_model:
            self._lora_model[name] = v.get("model")
        self._rebuild()

    def delete_lora(self, key: str) -> None:
        if self._lora_keys.pop(key, None) is not None:
            self._rebuild()

    # --- queries -------------------------------------------------------------------------------
    def workers(self, model: str, role: str) -> list[Worker]:
        return self._by_role.get((model, role), [])

    def serving_workers(self, model: str) -> list[Worker]:
        """The workers a client-facing request goes to: agg, or decode in a disaggregated model."""
        return self.workers(model, "agg") or self.workers(model, "decode")

    def ready_instances(self) -> list[Worker]:
        return [w for ws in self._by_role.values() for w in ws]

    def pool_of(self, instance: str | None) -> str | None:
        """The pool of a worker in the registry (ready or not): the latency metrics' label."""
        return self._pools.get(instance) if instance is not None else None

    def records(self) -> list[InstanceRecord]:
        """Every worker's instance record (any status, confirmed or not)."""
        return [r for r in self._records.values() if r.is_worker]

    def known_model(self, name: str) -> bool:
        """A card names this model (it may not be servable right now)."""
        return any(c.served_model_name == name for c in self._cards.values())

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
            if rec.status != "ready" or not rec.generate_subject or not rec.is_worker:
                continue
            if self.verify and (rec.instance, rec.started_at) not in self._confirmed:
                continue
            w = Worker(instance=rec.instance, model=rec.model, pool=rec.pool or rec.role, role=rec.role,
                       subject=rec.generate_subject, block_size=rec.block_size, host=rec.host,
                       started_at=rec.started_at)
            by_role.setdefault((rec.model, rec.role), []).append(w)
        for ws in by_role.values():
            ws.sort(key=lambda w: w.instance)  # stable order for round robin
        self._by_role = by_role
        self._pools = {rec.instance: rec.pool or rec.role for rec in self._records.values() if rec.is_worker}
        self.models = self._servable(by_role)
        live = {w.instance for ws in by_role.values() for w in ws}
        loras: dict[str, dict[str, Any]] = {}
        for name, inst in self._lora_keys.values():
            if inst in live:
                loras.setdefault(name, {"model": self._lora_model.get(name), "instances": set()})
                loras[name]["instances"].add(inst)
        self.loras = loras
        self._notify()

    def _servable(self, by_role: dict[tuple[str, str], list[Worker]]) -> dict[str, ModelEntry]:
        live_pools: dict[str, set[str]] = {}
        for (model, _role), ws in by_role.items():
            live_pools.setdefault(model, set()).update(w.pool for w in ws)
        models: dict[str, ModelEntry] = {}
        for card in self._cards.values():
            name = card.served_model_name
            if card.pool not in live_pools.get(name, ()):
                continue  # a card outlives its pool's workers: only live pools count
            models.setdefault(name, ModelEntry(name)).cards[card.pool] = card
        for name in list(models):
            agg = by_role.get((name, "agg"))
            decode = by_role.get((name, "decode"))
            prefill = by_role.get((name, "prefill"))
            embed = by_role.get((name, "embed"))
            if not (agg or embed or (decode and (prefill or self.decode_only(name)))):
                del models[name]  # e.g. prefill workers only, or decode without its prefill pool
        return models

    def _notify(self) -> None:
        for fn in self.listeners:
            try:
                fn()
            except Exception:
                log.exception("worker-set listener failed")

