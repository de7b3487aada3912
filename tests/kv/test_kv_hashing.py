"""Router hashing: Dynamo-compatible block hashes, chained sequence hashes, LoRA/salt seeds."""

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from actors.kv import hashing

BS = 4


def _ref_block(tokens: list[int], seed: int = 1337) -> int:
    # Independent reference: explicit little-endian u32 packing, as Dynamo's to_le_bytes.
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)


def test_block_hash_matches_reference_packing():
    toks = [1, 2, 3, 70000, 5, 6, 7, 2**32 - 1, 9]
    assert hashing.block_hashes(toks, BS) == [_ref_block(toks[0:4]), _ref_block(toks[4:8])]


def test_little_endian_bytes():
    assert hashing.tokens_to_bytes([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


def test_partial_block_ignored_and_empty():
    assert hashing.block_hashes([1, 2, 3], BS) == []
    assert len(hashing.sequence_hashes(list(range(11)), BS)) == 2


def test_sequence_chain_formula():
    toks = list(range(100, 112))
    b = hashing.block_hashes(toks, BS)
    s = hashing.sequence_hashes(toks, BS)
    assert s[0] == b[0]
    assert s[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", s[0], b[1]), seed=1337)
    assert s[2] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", s[1], b[2]), seed=1337)


def test_same_block_different_prefix_differs():
    a = hashing.sequence_hashes([1, 1, 1, 1, 9, 9, 9, 9], BS)
    b = hashing.sequence_hashes([2, 2, 2, 2, 9, 9, 9, 9], BS)
    assert a[1] != b[1]
    assert hashing.block_hashes([1, 1, 1, 1, 9, 9, 9, 9], BS)[1] == hashing.block_hashes(
        [2, 2, 2, 2, 9, 9, 9, 9], BS)[1]


def test_lora_and_salt_fold_into_seed():
    toks = list(range(8))
    plain = hashing.sequence_hashes(toks, BS)
    lora = hashing.sequence_hashes(toks, BS, lora_name="x")
    salt = hashing.sequence_hashes(toks, BS, salt="x")
    both = hashing.sequence_hashes(toks, BS, lora_name="x", salt="x")
    assert len({tuple(plain), tuple(lora), tuple(salt), tuple(both)}) == 4
    assert hashing.hash_seed() == 1337
    assert hashing.hash_seed("x") == xxhash.xxh3_64_intdigest(b"lora:x", seed=1337)
    assert lora[0] == _ref_block(toks[:4], seed=hashing.hash_seed("x"))


def test_bad_tokens_and_block_size():
    with pytest.raises(OverflowError):
        hashing.block_hashes([-1, 0, 0, 0], BS)
    with pytest.raises(OverflowError):
        hashing.block_hashes([2**32, 0, 0, 0], BS)
    with pytest.raises(ValueError):
        hashing.block_hashes([1], 0)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=60), st.lists(st.integers(0, 2**32 - 1), max_size=30),
       st.integers(1, 8))
def test_prefix_property(a, b, bs):
    """A request's hashes start with the hashes of any block-aligned prefix, and only full blocks count."""
    cut = len(a) - len(a) % bs
    full = hashing.sequence_hashes(a[:cut] + b, bs)
    assert full[: cut // bs] == hashing.sequence_hashes(a[:cut], bs)
    assert len(full) == (cut + len(b)) // bs
    assert hashing.chain_hashes(hashing.block_hashes(a, bs)) == hashing.sequence_hashes(a, bs)
