"""E/P/D's encoder outputs as the files of vLLM's ``ECExampleConnector``.

vLLM moves an image's encoder output between engines through its EC connector. The example
connector is a directory: a producer engine (encode-only) writes ``DIR/<mm_hash>/encoder_cache.safetensors``
for every image it encodes, and a consumer engine loads that file instead of running its own
encoder when it exists (and encodes the image itself when it does not). Here every engine has a
private directory of its own, and the files travel over the bus as bytes (``EncodedImage``): the
encode worker reads and deletes each file its engine wrote, the agg/prefill worker writes the file
into its engine's directory before the request reaches the engine.

* ``ConsumerStaging``: the files of a consumer engine, counted per image across the requests using
  them. A file outlives its last request for a while (``linger_*``): vLLM's scheduler checks that a
  file exists in one step and loads it in the engine step after, and a file deleted in between
  would be a ``FileNotFoundError`` inside the engine (the engine dies). Images are named by their
  content hash, so a file staged by one request is right for any other request with that image.
* ``take_output``: the producer's file of one image, read and deleted.
* ``OutputCache``: the encode worker's recent outputs by image id (LRU, bounded in bytes), so a
  repeated image (a multi-turn chat sends its images with every turn) skips the engine.
* ``check_output``: what an encoder output must look like before a consumer engine may load it.
  vLLM loads it with no check of its own: a malformed file, a dtype or a width the model does not
  use, fails inside the engine step, which kills the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections import OrderedDict
from pathlib import Path

FILE_NAME = "encoder_cache.safetensors"  # ECExampleConnector's file in DIR/<mm_hash>/
TENSOR = "ec_cache"  # the one tensor of that file
_HEX = frozenset("0123456789abcdef")
# bytes per element of the safetensors dtypes an encoder output can have
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 1 << 16  # one tensor's header is ~100 bytes


def check_name(name: str) -> str:
    """An image id names a directory: only what ``check_mm`` lets through (64 hex digits of a
    sha256) and our producer names (that, '-', more hex) may; never a path."""
    head, _, tail = name.partition("-")
    if len(head) != 64 or not set(head) <= _HEX or not set(tail) <= _HEX:
        raise ValueError(f"an image id is the sha256 hex of its data, not {name[:80]!r}")
    return name


def check_output(data: bytes, *, max_rows: int, width_unit: int | None, dtype: str | None) -> tuple[int, int]:
    """(rows, width) of an encoder output file; ValueError unless it is a safetensors file holding
    exactly one 2-D ``ec_cache`` tensor of ``dtype`` (the consumer model's), at most ``max_rows`` rows
    (the image's placeholder length: an image has no more embeddings than placeholder tokens) and a
    width that is a multiple of ``width_unit`` (the language model's hidden size; DeepStack
    models stack several layers' outputs side by side)."""
    if len(data) < 8:
        raise ValueError("an encoder output is a safetensors file; this one is too short")
    n = int.from_bytes(data[:8], "little")
    if not 2 <= n <= min(_MAX_HEADER, len(data) - 8):
        raise ValueError("an encoder output is a safetensors file; its header length is wrong")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, ValueError):
        raise ValueError("an encoder output is a safetensors file; its header is not JSON") from None
    if not isinstance(header, dict) or set(header) - {"__metadata__"} != {TENSOR}:
        raise ValueError(f"an encoder output holds one tensor named {TENSOR!r}")
    t = header[TENSOR]
    shape = t.get("shape") if isinstance(t, dict) else None
    offsets = t.get("data_offsets") if isinstance(t, dict) else None
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ValueError("an encoder output is a 2-D tensor [embeddings, width]")
    rows, width = shape
    size = _DTYPE_BYTES.get(t.get("dtype"))  # type: ignore[arg-type]
    if size is None or (dtype is not None and t["dtype"] != dtype):
        raise ValueError(f"an encoder output of this model is {dtype or 'a float tensor'}, not {t.get('dtype')!r}")
    if offsets != [0, rows * width * size] or 8 + n + rows * width * size != len(data):
        raise ValueError("an encoder output's data does not match its header")
    if rows > max_rows:
        raise ValueError(f"an encoder output has {rows} embeddings for an image of {max_rows} placeholder tokens")
    if width_unit and width % width_unit:
        raise ValueError(f"an encoder output is {width} wide; this model's are multiples of {width_unit}")
    return rows, width


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so the engine never sees part of it: a temporary name, then a rename."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class ConsumerStaging:
    """Encoder outputs staged in a consumer engine's connector directory, one file per image."""

    def __init__(self, root: Path, *, linger_files: int = 64, linger_bytes: int = 256 << 20) -> None:
        self.root = root
        self.linger_files = linger_files
        self.linger_bytes = linger_bytes
        self._held: dict[str, int] = {}  # image id -> requests holding its file
        self._sizes: dict[str, int] = {}  # image id -> file bytes (held or lingering)
        self._linger: OrderedDict[str, None] = OrderedDict()  # released files, oldest first
        self._linger_total = 0

    def path(self, uuid: str) -> Path:
        return self.root / check_name(uuid) / FILE_NAME

    def stage(self, uuid: str, data: bytes) -> None:
        """Hold ``uuid``'s file for one more request, writing it unless it is there already (the
        same id is the same image, so the same output)."""
        if uuid in self._linger:
            del self._linger[uuid]
            self._linger_total -= self._sizes[uuid]
        elif uuid not in self._held:
            _write_atomic(self.path(uuid), data)
            self._sizes[uuid] = len(data)
        self._held[uuid] = self._held.get(uuid, 0) + 1

    def release(self, uuid: str) -> None:
        """One request is done with ``uuid``'s file; the last one lets it linger."""
        n = self._held.get(uuid, 0) - 1
        if n > 0:
            self._held[uuid] = n
            return
        self._held.pop(uuid, None)
        if uuid not in self._sizes:
            return
        self._linger[uuid] = None
        self._linger_total += self._sizes[uuid]
        while self._linger and (len(self._linger) > self.linger_files or self._linger_total > self.linger_bytes):
            old, _ = self._linger.popitem(last=False)
            self._linger_total -= self._sizes.pop(old)
            self._remove(old)

    def sweep(self, uuids: list[str]) -> None:
        """vLLM's connector makes ``DIR/<id>/`` for every image it looks up, staged or not: remove
        the empty ones of these images (rmdir fails on a directory holding a file: safe)."""
        for uuid in uuids:
            if uuid not in self._sizes:
                with contextlib.suppress(OSError, ValueError):
                    os.rmdir(self.root / check_name(uuid))

    def _remove(self, uuid: str) -> None:
        path = self.path(uuid)
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()

    def held(self) -> dict[str, int]:
        return dict(self._held)

    def lingering(self) -> list[str]:
        return list(self._linger)


def take_output(root: Path, name: str) -> bytes | None:
    """The producer's output file for ``name`` (None when it wrote none), and its directory removed."""
    folder = root / check_name(name)
    try:
        data = (folder / FILE_NAME).read_bytes()
    except OSError:
        data = None
    shutil.rmtree(folder, ignore_errors=True)
    return data


def drop_output(root: Path, name: str) -> None:
    """The producer's output directory for ``name`` removed, unread (a cancelled run's)."""
    shutil.rmtree(root / check_name(name), ignore_errors=True)


class OutputCache:
    """Recent encoder outputs by image id, least recently used first out, at most ``max_bytes``
    together (an output larger than that is not kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._total = 0
        self.hits = 0
        self.misses = 0

    def get(self, uuid: str) -> bytes | None:
        data = self._items.get(uuid)
        if data is None:
            self.misses += 1
            return None
        self._items.move_to_end(uuid)
        self.hits += 1
        return data

    def put(self, uuid: str, data: bytes) -> None:
        old = self._items.pop(uuid, None)
        if old is not None:
            self._total -= len(old)
        if len(data) > self.max_bytes:
            return
        self._items[uuid] = data
        self._total += len(data)
        while self._total > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._total -= len(dropped)

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._items)
