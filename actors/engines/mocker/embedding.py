"""The mocker's embeddings (role "embed"): a deterministic vector per prompt, shaped as vLLM's
pooler shapes one. No model: a seeded normal draw keyed by the prompt's token ids and the
engine's seed (its "weights"), so equal inputs give equal vectors and different inputs different
ones, which is what the tests of an embedding service can check.
"""

from __future__ import annotations

import hashlib

import numpy as np

from actors.engines.mocker.config import MockerArgs


def check_dimensions(args: MockerArgs, model: str, dimensions: int | None) -> int | None:
    """vLLM's check of a request's ``dimensions`` (``PoolingParams``, in its words), as ValueErrors;
    the length the embedding is cut to (None: whole)."""
    if dimensions is None:
        return None
    if not args.is_matryoshka and not args.matryoshka_dimensions:
        raise ValueError(f"Model {model!r} does not support Matryoshka embeddings; dimensions must be "
                         f"unset (received dimensions={dimensions}).")
    if not 1 <= dimensions <= args.embedding_size:
        raise ValueError(f"Model {model!r} only supports dimensions in range [1, {args.embedding_size}], "
                         f"got {dimensions}.")
    mds = args.matryoshka_dimensions
    if mds is not None and dimensions not in mds:
        raise ValueError(f"Model {model!r} only supports Matryoshka dimensions {list(mds)}, got {dimensions}.")
    return dimensions


def embedding(token_ids: list[int], seed: int, size: int, dimensions: int | None, normalize: bool) -> bytes:
    """The prompt's embedding as little-endian float32 bytes: cut to ``dimensions`` first, then
    normalized (the pooler's activation, on unless the request turns it off), as vLLM's
    Matryoshka pooling does."""
    key = hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes() + seed.to_bytes(8, "little", signed=True))
    rng = np.random.default_rng(int.from_bytes(key.digest()[:8], "little"))
    vec = rng.standard_normal(size)[:dimensions]
    if normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec.astype("<f4").tobytes()
