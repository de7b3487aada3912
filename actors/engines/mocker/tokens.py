"""Deterministic pseudo-tokens, trivial (de)tokenization, and vLLM-style chained block hashes.

Everything here is a pure function so tests can predict the mocker's output exactly.

- ``next_token``: XXH3-64 over (the last ``HISTORY`` token ids, the sequence length, the attempt
  number) with a seed folded from (engine seed, LoRA name, request seed), mod ``vocab_size``.
  Identical prompts therefore give identical outputs; a LoRA or a request ``seed`` changes them.
  Temperature does not matter (the mocker always "samples greedily").
- Text prompts are tokenized as their UTF-8 bytes (ids 0..255); output text is ``" t<id>"`` per token.
- Embedding prompts: one id per row, the XXH3-64 of the row's bytes mod ``vocab_size``, so equal
  leading rows give equal ids (and prefix-cache hits), like vLLM's embedding digests.
- ``block_hash``: a 64-bit int chaining the parent block's hash, the block's token ids and its
  extra keys (LoRA name), with vLLM's semantics (exact sha256 equality with vLLM is not a goal).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

HISTORY = 8
_MASK64 = (1 << 64) - 1


def _seed(engine_seed: int, lora_name: str | None, request_seed: int | None) -> int:
    s = xxhash.xxh3_64_intdigest(
        f"{engine_seed}|{lora_name or ''}|{'' if request_seed is None else request_seed}".encode())
    return s


def next_token(history: Sequence[int], vocab_size: int, engine_seed: int = 0,
               lora_name: str | None = None, request_seed: int | None = None,
               attempt: int = 0) -> int:
    """The token the mocker generates after ``history`` (prompt + output so far)."""
    return token_after(history[-HISTORY:], len(history), vocab_size,
                       _seed(engine_seed, lora_name, request_seed), attempt)


def token_after(tail: Sequence[int], length: int, vocab_size: int, hash_seed: int,
                attempt: int = 0) -> int:
    """``next_token`` from the last ``HISTORY`` ids and the full length (the hot path)."""
    data = array("q", [*tail, length, attempt]).tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=hash_seed) % vocab_size


def hash_seed(engine_seed: int, lora_name: str | None, request_seed: int | None) -> int:
    return _seed(engine_seed, lora_name, request_seed)


def predict_output(prompt: Sequence[int], max_tokens: int, vocab_size: int, engine_seed: int = 0,
                   lora_name: str | None = None, request_seed: int | None = None,
                   eos_token_id: int | None = None, min_tokens: int = 0,
                   stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> list[int]:
    """The whole output for a prompt (same rules as the engine: EOS/stop ids end it unless
    fewer than ``min_tokens`` were generated, in which case they are re-drawn)."""
    seq = list(prompt)
    out: list[int] = []
    banned = set(stop_token_ids)
    if eos_token_id is not None and not ignore_eos:
        banned.add(eos_token_id)
    while len(out) < max_tokens:
        tok = draw(seq, vocab_size, engine_seed, lora_name, request_seed,
                   banned if len(out) < min_tokens else set())
        seq.append(tok)
        out.append(tok)
        if tok in banned:
            break
    return out


def draw(history: Sequence[int], vocab_size: int, engine_seed: int, lora_name: str | None,
         request_seed: int | None, banned: set[int]) -> int:
    """``next_token``, re-drawn while it is banned (min_tokens masks EOS/stop ids, as vLLM does)."""
    attempt = 0
    while True:
        tok = next_token(history, vocab_size, engine_seed, lora_name, request_seed, attempt)
        if tok not in banned or len(banned) >= vocab_size:
            return tok
        attempt += 1


def fake_logprob(token_id: int, rank: int) -> float:
    """Deterministic, decreasing with rank, always < 0."""
    return -(0.05 + rank * 0.7 + (token_id % 97) / 1000.0)


def tokenize_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def detokenize(token_ids: Sequence[int]) -> str:
    return "".join(f" t{t}" for t in token_ids)


def embeds_token_ids(tensor: Any, vocab_size: int, num_tokens: int = 0) -> list[int]:
    """Pseudo token ids for a ``[seq, hidden]`` (or ``[1, seq, hidden]``) embedding tensor."""
    rows = _rows(tensor)
    if num_tokens and num_tokens != len(rows):
        if len(rows) == 0:
            return [0] * num_tokens
        raise ValueError(f"EmbedsPrompt.num_tokens={num_tokens} but the tensor has {len(rows)} rows")
    return [xxhash.xxh3_64_intdigest(r) % vocab_size for r in rows]


def _rows(tensor: Any) -> list[bytes]:
    obj = tensor
    if hasattr(obj, "detach"):  # torch.Tensor: avoid importing torch ourselves
        obj = obj.detach().cpu().float().numpy()
    if hasattr(obj, "tobytes") and hasattr(obj, "shape"):  # numpy
        if len(obj.shape) == 3:
            obj = obj.reshape(obj.shape[1], obj.shape[2]) if obj.shape[0] == 1 else obj
        if len(obj.shape) != 2:
            raise ValueError(f"prompt embeddings must be [seq, hidden], got shape {tuple(obj.shape)}")
        return [obj[i].astype("float32").tobytes() for i in range(obj.shape[0])]
    if isinstance(obj, list | tuple):  # nested lists
        if obj and isinstance(obj[0], list | tuple) and obj[0] and isinstance(obj[0][0], list | tuple):
            obj = obj[0]
        return [array("d", [float(x) for x in row]).tobytes() for row in obj]
    raise ValueError(f"unsupported prompt embeddings type {type(tensor).__name__}")


def block_hash(parent: int | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None) -> int:
    """Chained 64-bit hash of one full block (parent hash, tokens, extra keys)."""
    h = xxhash.xxh3_64()
    h.update((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(b"\x01" if parent is not None else b"\x00")
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.intdigest() & _MASK64
