"""E/P/D's encoder-output files (actors.engines.ec_staging), without an engine: the checks a consumer
runs before its engine may load an output, the consumer's per-image files (held, lingering, swept)
and the encode worker's output cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from actors.engines.ec_staging import (
    FILE_NAME,
    ConsumerStaging,
    OutputCache,
    check_name,
    check_output,
    take_output,
)

U1, U2, U3 = "1" * 64, "2" * 64, "3" * 64


def output(rows: int = 20, width: int = 128, dtype: torch.dtype = torch.bfloat16, **more: torch.Tensor) -> bytes:
    return save({"ec_cache": torch.ones(rows, width, dtype=dtype), **more})


def test_a_well_formed_output_passes() -> None:
    assert check_output(output(), max_rows=33, width_unit=128, dtype="BF16") == (20, 128)
    # DeepStack models stack layers side by side: a multiple of the hidden size
    assert check_output(output(width=384), max_rows=20, width_unit=128, dtype="BF16") == (20, 384)
    assert check_output(output(dtype=torch.float16), max_rows=20, width_unit=None, dtype=None) == (20, 128)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "too short"),
    (b"\xff" * 8 + b"{}", "header length"),
    ((9).to_bytes(8, "little") + b"not json!", "not JSON"),
    (output(ec_extra=torch.ones(1)), "one tensor named 'ec_cache'"),
    (save({"other": torch.ones(2, 128)}), "one tensor named 'ec_cache'"),
    (save({"ec_cache": torch.ones(2, 3, 128, dtype=torch.bfloat16)}), "2-D tensor"),
    (output(dtype=torch.float32), "is BF16, not 'F32'"),
    (output()[:-2], "does not match its header"),
    (output() + b"xx", "does not match its header"),
    (output(rows=34), "34 embeddings for an image of 33 placeholder tokens"),
    (output(width=100), "100 wide; this model's are multiples of 128"),
])
def test_a_malformed_output_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_output(data, max_rows=33, width_unit=128, dtype="BF16")


@pytest.mark.parametrize("name", ["", "../" + "a" * 61, "A" * 64, "a" * 63, "a" * 64 + "-x/y", "a" * 64 + "/.."])
def test_an_image_id_never_names_a_path(name: str) -> None:
    with pytest.raises(ValueError, match="sha256 hex"):
        check_name(name)
    assert check_name("a" * 64) == "a" * 64 and check_name("a" * 64 + "-0f3c") == "a" * 64 + "-0f3c"


def test_consumer_files_are_held_per_request_then_linger_then_go(tmp_path: Path) -> None:
    st = ConsumerStaging(tmp_path, linger_files=2, linger_bytes=1 << 20)
    data = output()
    st.stage(U1, data)
    st.stage(U1, b"not written again: same image, same output")
    assert st.path(U1).read_bytes() == data and st.held() == {U1: 2}
    assert [p.name for p in tmp_path.iterdir()] == [U1]  # no temporary file left behind
    st.release(U1)
    assert st.held() == {U1: 1} and st.path(U1).exists()
    st.release(U1)
    assert st.held() == {} and st.lingering() == [U1] and st.path(U1).exists()
    st.stage(U1, b"")  # a lingering file is held again as it is
    assert st.held() == {U1: 1} and st.lingering() == [] and st.path(U1).read_bytes() == data
    st.release(U1)
    for u in (U2, U3):
        st.stage(u, data)
        st.release(u)
    # three released files, two may linger: the oldest goes, with its directory
    assert st.lingering() == [U2, U3] and not (tmp_path / U1).exists()


def test_lingering_is_bounded_in_bytes(tmp_path: Path) -> None:
    data = output()
    st = ConsumerStaging(tmp_path, linger_files=10, linger_bytes=len(data) + 1)
    for u in (U1, U2):
        st.stage(u, data)
    st.release(U1)
    st.release(U2)
    assert st.lingering() == [U2] and sorted(os.listdir(tmp_path)) == [U2]


def test_sweep_removes_the_empty_directories_the_connector_made(tmp_path: Path) -> None:
    """vLLM's file connector makes DIR/<id>/ for every image it looks up; a file's directory stays."""
    st = ConsumerStaging(tmp_path)
    st.stage(U1, output())
    (tmp_path / U2).mkdir()
    st.sweep([U1, U2, "../etc"])
    assert sorted(os.listdir(tmp_path)) == [U1] and st.path(U1).exists()


def test_take_output_reads_and_removes(tmp_path: Path) -> None:
    name = U1 + "-ab12"
    (tmp_path / name).mkdir()
    (tmp_path / name / FILE_NAME).write_bytes(b"out")
    assert take_output(tmp_path, name) == b"out" and not (tmp_path / name).exists()
    (tmp_path / U2).mkdir()  # looked up, never written
    assert take_output(tmp_path, U2) is None and not (tmp_path / U2).exists()


def test_output_cache_is_lru_bounded_in_bytes() -> None:
    c = OutputCache(max_bytes=10)
    c.put(U1, b"1111")
    c.put(U2, b"2222")
    assert c.get(U1) == b"1111"  # U1 is now the most recent
    c.put(U3, b"3333")
    assert c.get(U2) is None and c.get(U1) == b"1111" and c.get(U3) == b"3333"
    assert c.total_bytes == 8 and len(c) == 2 and (c.hits, c.misses) == (3, 1)
    c.put(U2, b"x" * 11)  # larger than the whole cache: not kept, nothing evicted for it
    assert len(c) == 2 and c.get(U2) is None
    c.put(U1, b"11")  # replaced, counted once
    assert c.total_bytes == 6


def test_which_engines_take_part_in_epd_and_where_their_files_go(tmp_path: Path) -> None:
    """vllm_args.ec_transfer_config: encode produces, agg/prefill beside an encode pool consume, each
    in a private directory of its own; a topology's own ec_transfer_config wins."""
    from actors.engines.vllm_args import ec_transfer_config

    made: list[Path] = []
    try:
        for role, consumer, ec_role in (("encode", False, "ec_producer"), ("agg", True, "ec_consumer"),
                                        ("prefill", True, "ec_consumer")):
            cfg, root, owned = ec_transfer_config(role, consumer, {})  # type: ignore[arg-type]
            assert root is not None and owned
            made.append(root)
            assert cfg == {"ec_connector": "ECExampleConnector", "ec_role": ec_role,
                           "ec_connector_extra_config": {"shared_storage_path": str(root)}}
            assert root.is_dir() and root.stat().st_mode & 0o777 == 0o700
        assert len(set(made)) == 3
        for role, consumer in (("agg", False), ("decode", True)):
            assert ec_transfer_config(role, consumer, {}) == (None, None, False)  # type: ignore[arg-type]
        # the topology's own: its directory (kept), or ours when it names none
        own = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
               "ec_connector_extra_config": {"shared_storage_path": str(tmp_path / "shared")}}
        assert ec_transfer_config("agg", True, {"ec_transfer_config": own}) == (own, tmp_path / "shared", False)
        assert (tmp_path / "shared").is_dir()
        cfg, root, owned = ec_transfer_config("encode", False, {"ec_transfer_config": {
            "ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}})
        assert root is not None and owned and cfg is not None
        made.append(root)
        assert cfg["ec_connector_extra_config"] == {"shared_storage_path": str(root)}
        # another connector carries the outputs itself: nothing staged by the worker
        mooncake = {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_consumer"}
        assert ec_transfer_config("agg", True, {"ec_transfer_config": mooncake}) == (mooncake, None, False)
        with pytest.raises(ValueError, match="hands its encoder outputs over as ECExampleConnector files"):
            ec_transfer_config("encode", False, {"ec_transfer_config": {**mooncake, "ec_role": "ec_producer"}})
        with pytest.raises(ValueError, match='needs ec_role = "ec_producer"'):
            ec_transfer_config("encode", False, {"ec_transfer_config": {**own, "ec_role": "ec_both"}})
    finally:
        for root in made:
            root.rmdir()
