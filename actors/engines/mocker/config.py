"""Mocker engine arguments (the ``args`` dict of a topology's mocker engine).

Keys (all optional; an unknown key is a ValueError naming it):

| key | default | meaning |
|---|---|---|
| block_size | 16 | tokens per KV block (Dynamo's default; use 32 to mirror vLLM-CPU) |
| num_gpu_blocks | 16384 | KV blocks per DP rank |
| max_num_seqs | 256 | max running requests per rank |
| max_num_batched_tokens | 8192 | token budget per scheduler step |
| enable_prefix_caching | True | prefix cache + KV events |
| enable_chunked_prefill | True | split long prompts over steps (off: budget must cover max_model_len) |
| speedup_ratio | 1.0 | divide simulated compute time; 0 or "inf" = no compute, no sleeping |
| max_model_len | 8192 | prompt + output cap (a longer prompt is rejected) |
| vocab_size | 32000 | pseudo-token range |
| eos_token_id | 2 | EOS id (generated tokens ending the request unless ignore_eos) |
| max_logprobs | 20 | top logprobs a request may ask for, as vLLM's ``--max-logprobs`` (-1: vocab_size) |
| dp_size | 1 | data-parallel ranks: one scheduler, pool and KV-event port each |
| enable_lora | False | accept LoRA requests |
| max_loras | 1 | distinct adapters in one running batch (vLLM's max_loras) |
| max_cpu_loras | max_loras | adapters kept loaded; adding more evicts the least recently used |
| die_at_start | False | ``start()`` fails with EngineDeadError |
| die_after_tokens | None | the engine dies once this many tokens were generated (all requests) |
| hang_after_tokens | None | the engine stalls forever after this many tokens (health stays OK) |
| poison_token_id | None | a request whose prompt holds this id SIGKILLs the worker process, as the OOM killer stops a request of death (chaos tests) |
| kv_events_buffer_steps | 10000 | replay ring size (batches) |
| tokenizer | None | a tokenizer directory (its ``tokenizer.json``) or file: text prompts are encoded and output text decoded with it instead of bytes and ``" t<id>"``; ``script`` needs it (a worker passes its model's when the pool has a script) |
| script | [] | scripted replies (below) |
| input_modalities | ["text"] | what prompts may hold: add "image" to take image prompts (token ids already expanded, plus ``mm``); their blocks are cached and published under vLLM's image keys, the images themselves are not looked at |
| embedding_size | 128 | role "embed": the length of an embedding (a worker sets the model's ``hidden_size``) |
| is_matryoshka | False | role "embed": a request's ``dimensions`` may shorten the embedding (vLLM's Matryoshka models) |
| matryoshka_dimensions | None | role "embed": the only ``dimensions`` allowed (a list), as a model's config names them |

``script`` is a list of tables ``{ when = "substring", text = "reply" }`` (TOML: an array of inline
tables, or ``[[pools.<name>.engine_args.script]]`` blocks). For each request the first entry whose
``when`` occurs in the prompt's text wins (token prompts are decoded with ``tokenizer``, special
tokens kept, so the chat template's text, tools included, is part of what is searched; a text
prompt is searched as given); ``when = ""`` or no ``when`` matches every prompt. The reply is
``text`` encoded with ``tokenizer`` (no special tokens added), one token per step, then
``eos_token_id`` with finish_reason "stop"; ``max_tokens`` (and ``max_model_len``) still cut it with
"length", a stop token id in it still stops it, and ``min_tokens``/``ignore_eos`` do not apply. A
prompt that ends with the reply's first tokens (a migrated request) gets the rest of it. A prompt no
entry matches, and every embeddings prompt, gets the usual pseudo-tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from actors.engines.mocker.script import ScriptEntry, parse_script
from actors.engines.mocker.timing import parse_speedup

MODALITIES = frozenset({"text", "image"})


@dataclasses.dataclass(frozen=True)
class MockerArgs:
    block_size: int = 16
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speedup_ratio: float = 1.0
    max_model_len: int = 8192
    vocab_size: int = 32000
    eos_token_id: int = 2
    max_logprobs: int = 20
    dp_size: int = 1
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    die_at_start: bool = False
    die_after_tokens: int | None = None
    hang_after_tokens: int | None = None
    poison_token_id: int | None = None
    kv_events_buffer_steps: int = 10_000
    tokenizer: str | None = None
    script: tuple[ScriptEntry, ...] = ()
    input_modalities: tuple[str, ...] = ("text",)
    embedding_size: int = 128
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, args: dict[str, Any] | None) -> MockerArgs:
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in args:
            if key not in known:
                raise ValueError(f"unknown mocker engine arg {key!r} (known: {', '.join(sorted(known))})")
        if "speedup_ratio" in args:
            args["speedup_ratio"] = parse_speedup(args["speedup_ratio"])
        if "script" in args:
            args["script"] = parse_script(args["script"])
        for key in ("input_modalities", "matryoshka_dimensions"):
            if isinstance(args.get(key), list):  # TOML arrays are lists
                args[key] = tuple(args[key])
        out = cls(**args)
        out.validate()
        return out

    @property
    def lora_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def zero_compute(self) -> bool:
        return math.isinf(self.speedup_ratio)

    def validate(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "vocab_size", "dp_size", "max_loras", "embedding_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"mocker arg {name} must be a positive int, got {v!r}")
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_gpu_blocks*block_size = {self.num_gpu_blocks * self.block_size} tokens cannot "
                f"hold one max_model_len={self.max_model_len} sequence (vLLM refuses this too)")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) \
                or self.max_logprobs < -1:
            raise ValueError(f"mocker arg max_logprobs must be an int >= -1, got {self.max_logprobs!r}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} outside vocab_size {self.vocab_size}")
        for name in ("die_after_tokens", "hang_after_tokens", "max_cpu_loras", "poison_token_id"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"mocker arg {name} must be a non-negative int or None, got {v!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"mocker arg tokenizer must be a path, got {self.tokenizer!r}")
        mods = self.input_modalities
        if not isinstance(mods, tuple) or "text" not in mods \
                or not all(isinstance(m, str) and m in MODALITIES for m in mods):
            raise ValueError(f"mocker arg input_modalities must list \"text\" and optionally \"image\", "
                             f"got {mods!r}")
        mds = self.matryoshka_dimensions
        if mds is not None and not (isinstance(mds, tuple) and mds and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 < d <= self.embedding_size for d in mds)):
            raise ValueError(f"mocker arg matryoshka_dimensions must list dimensions in [1, {self.embedding_size}] "
                             f"(embedding_size), got {mds!r}")
        if self.script and self.tokenizer is None:
            raise ValueError("mocker arg script needs a tokenizer (the text is encoded with it): set the "
                             "topology's model, or the mocker arg tokenizer")
