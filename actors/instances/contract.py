"""The registry's records: the values of ``<ns>-instances`` and ``<ns>-models`` (JSON, read by
``nats kv get``).

This module is their one owner: actors write them (``actors.base.Actor.record``, the engine actor's
record and model card) and every reader decodes them with these types (the frontend's worker set,
the KV router feed). It is a wire contract, so ``actors.base`` (a sibling in its layer) may use it.
"""

from __future__ import annotations

from typing import Final

import msgspec

# The kind of the instance record that serves generate and publishes KV events (the engine actor).
# The other kinds in the bucket are its helpers (kv_publisher, lora, health) and the frontend, echo.
WORKER_KIND: Final = "engine"


class InstanceRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Value in ns-instances: one key per live actor instance."""

    instance: str
    kind: str  # WORKER_KIND, "kv_publisher", "lora", "health", "frontend", "echo", ...
    role: str
    model: str
    host: str
    pid: int
    pool: str | None = None
    generate_subject: str | None = None
    block_size: int | None = None
    dp_size: int = 1
    status: str = "ready"
    started_at: float = 0.0

    @property
    def is_worker(self) -> bool:
        """A worker's own record: routed to, and indexed by the KV router."""
        return self.kind == WORKER_KIND


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Value in ns-models (key: ``<served name>.<pool>``)."""

    served_model_name: str
    pool: str
    role: str
    model_path: str
    tokenizer_path: str
    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    dp_size: int = 1
    migration_limit: int = 3
    chat_template: str | None = None
    # the limits a frontend checks requests against (actors.engines.limits); a card written before
    # they were recorded decodes with no vocabulary (ids checked against int32 only) and vLLM's default
    vocab_size: int | None = None
    max_logprobs: int = 20
    # what a frontend checks a client's prompt_embeds against before routing them; a card written
    # before they were recorded reads as "not enabled": refused at the frontend, never sent unchecked
    hidden_size: int | None = None
    prompt_embeds: bool = False  # the pool's prompt_embeds (vLLM's --enable-prompt-embeds)
    # what a prompt may hold besides tokens: ["text", "image"] for a vision-language model; a card
    # written before this was recorded reads as text only (images refused at the frontend)
    input_modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])
    # an embedding model (its pool's role is "embed"): the length of its embeddings and what a
    # request's ``dimensions`` may ask for (Matryoshka), checked at the frontend as vLLM checks them
    embedding_size: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
