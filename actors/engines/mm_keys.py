"""Which images a KV block holds, named as vLLM names them in its block hashes and KV events.

vLLM 0.32 (``vllm/v1/core/kv_cache_utils.py``, ``_gen_mm_extra_hash_keys``) gives the block of
tokens ``[s, e)`` one extra key ``(identifier, offset - s)`` for every image whose placeholder range
``[offset, offset + length)`` overlaps it, in image order: the offset is relative to the block's
start, so it is negative in the blocks after the one where the image starts. The identifier is the
image's ``multi_modal_uuids`` entry (our content hash, ``ImageInput.uuid``). ``BlockStored.extra_keys``
carries exactly these pairs (msgpack turns the tuples into 2-lists).

The frontend's router hashes (``actors.kv.hashing``) and the mocker's prefix cache and events
compute the pairs with this rule; the KV publisher (``actors.kv.translate``) reads vLLM's own pairs
from its events and folds them as the router does (``hashing.fold_mm``). It lives here, below
``actors.kv``, because the mocker is an engine and may not import upward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from actors.engines.protocol import MultiModalInput

MmKey = tuple[str, int]  # (identifier, offset of the image relative to the block's first token)


class MmSpan(NamedTuple):
    """One image of a prompt: its identifier and placeholder range in the expanded prompt."""

    identifier: str
    offset: int
    length: int


def mm_spans(mm: MultiModalInput | None) -> list[MmSpan] | None:
    """The spans of a request's images (None without images): what routing hashes with."""
    if mm is None or not mm.images:
        return None
    return [MmSpan(img.uuid, off, n) for img, (off, n) in zip(mm.images, mm.placeholders, strict=True)]


def mm_block_keys(spans: Sequence[MmSpan], block_size: int, n_blocks: int) -> list[tuple[MmKey, ...]]:
    """Per block ``0..n_blocks-1``: the ``(identifier, offset - block_start)`` of every image that
    overlaps it, in image order (``()`` for a block without images).

    vLLM's own loop, step for step: it carries the index of the first image not yet passed from
    block to block and stops at the first image a block has not reached, or at one that runs past
    it. Spans are in prompt order (vLLM assumes its placeholders sorted by offset; a processed
    prompt has them so).
    """
    out: list[tuple[MmKey, ...]] = []
    n_spans = len(spans)
    if not n_spans:
        return [()] * n_blocks
    last_end = spans[-1].offset + spans[-1].length
    idx = 0
    for b in range(n_blocks):
        s = b * block_size
        e = s + block_size
        if last_end <= s:  # past the last image: vLLM returns early, its index unchanged
            out.append(())
            continue
        keys: list[MmKey] = []
        while idx < n_spans:
            ident, offset, length = spans[idx]
            if e <= offset:
                break  # the block has not reached this image
            if s >= offset + length:
                idx += 1  # the block has passed this image
                continue
            keys.append((ident, offset - s))
            if e >= offset + length:
                idx += 1  # the image ends here; the next may start in this block too
            else:
                break  # the image runs on past this block
        out.append(tuple(keys))
    return out
