"""LoRA manager logic: URI resolution, capacity, idempotence, rollback, re-apply."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from aiohttp import web

from actors.worker import lora_source
from actors.worker.contract import LoraInfo
from actors.worker.lora_manager import LoraManager
from bus.errors import BadRequest, Conflict, NotFound, Overloaded, RemoteError


def make_adapter(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return path


class RecordingEngine:
    """Engine side of the manager: records calls; can be told to fail."""

    def __init__(self) -> None:
        self.adapters: dict[str, tuple[int, str]] = {}
        self.fail_add = False

    async def add(self, name: str, lora_id: int, path: str) -> None:
        if self.fail_add:
            raise RuntimeError("engine refused the adapter")
        self.adapters[name] = (lora_id, path)

    async def remove(self, name: str) -> None:
        self.adapters.pop(name, None)


class DictStore:
    def __init__(self) -> None:
        self.records: dict[str, LoraInfo] = {}
        self.fail_put = False

    async def put(self, info: LoraInfo) -> None:
        if self.fail_put:
            raise RuntimeError("registry unavailable")
        self.records[info.lora_name] = info

    async def delete(self, name: str) -> None:
        self.records.pop(name, None)

    async def load_all(self) -> list[LoraInfo]:
        return list(self.records.values())


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    make_adapter(root / "a1")
    make_adapter(root / "a2")
    make_adapter(root / "a3")
    return root


def manager(roots: Path, tmp_path: Path, max_loras: int = 2, fetch: lora_source.FetchPolicy | None = None
            ) -> tuple[LoraManager, RecordingEngine, DictStore]:
    eng, store = RecordingEngine(), DictStore()
    return LoraManager(eng, store, roots=[str(roots)], cache_dir=str(tmp_path / "cache"),
                       max_loras=max_loras, fetch=fetch), eng, store


def test_file_uri_inside_root(roots: Path) -> None:
    assert lora_source.resolve_file_uri(f"file://{roots}/a1", [str(roots)]) == (roots / "a1").resolve()


@pytest.mark.parametrize("suffix", ["/a1/../../etc", "/../adapters/a1"])
def test_file_uri_dotdot_rejected(roots: Path, suffix: str) -> None:
    with pytest.raises(BadRequest, match="traversal"):
        lora_source.resolve_file_uri(f"file://{roots}{suffix}", [str(roots)])


def test_symlink_escape_rejected(roots: Path, tmp_path: Path) -> None:
    outside = make_adapter(tmp_path / "outside")
    os.symlink(outside, roots / "sneaky")
    with pytest.raises(BadRequest, match="outside the allowed roots"):
        lora_source.resolve_file_uri(f"file://{roots}/sneaky", [str(roots)])


def test_missing_adapter_and_no_roots(roots: Path) -> None:
    with pytest.raises(NotFound):
        lora_source.resolve_file_uri(f"file://{roots}/nope", [str(roots)])
    with pytest.raises(BadRequest, match="no lora.roots"):
        lora_source.resolve_file_uri(f"file://{roots}/a1", [])


async def test_unsupported_scheme() -> None:
    with pytest.raises(BadRequest, match="scheme"):
        await lora_source.resolve("s3://bucket/x", [], "/tmp")


async def test_load_unload_list(roots: Path, tmp_path: Path) -> None:
    mgr, eng, store = manager(roots, tmp_path)
    info, new = await mgr.load("one", f"file://{roots}/a1")
    assert new and info.lora_id == 1 and eng.adapters["one"][0] == 1
    assert store.records["one"].uri.endswith("/a1")
    # idempotent re-load
    again, new = await mgr.load("one", f"file://{roots}/a1")
    assert not new and again == info
    with pytest.raises(Conflict):
        await mgr.load("one", f"file://{roots}/a2")
    await mgr.load("two", f"file://{roots}/a2")
    with pytest.raises(Overloaded, match="capacity"):
        await mgr.load("three", f"file://{roots}/a3")
    assert [i.lora_name for i in mgr.list()] == ["one", "two"]
    await mgr.unload("one")
    assert "one" not in eng.adapters and "one" not in store.records
    with pytest.raises(NotFound):
        await mgr.unload("one")
    info3, _ = await mgr.load("three", f"file://{roots}/a3")
    assert info3.lora_id == 3  # ids are not reused while the engine may still cache the old one


async def test_bad_name(roots: Path, tmp_path: Path) -> None:
    mgr, _, _ = manager(roots, tmp_path)
    with pytest.raises(BadRequest, match="invalid lora_name"):
        await mgr.load("../etc", f"file://{roots}/a1")


async def test_rollback_when_registry_fails(roots: Path, tmp_path: Path) -> None:
    mgr, eng, store = manager(roots, tmp_path)
    store.fail_put = True
    with pytest.raises(RuntimeError, match="registry"):
        await mgr.load("one", f"file://{roots}/a1")
    assert eng.adapters == {} and mgr.list() == []
    store.fail_put = False
    await mgr.load("one", f"file://{roots}/a1")  # the slot was released


async def test_reapply_after_restart(roots: Path, tmp_path: Path) -> None:
    mgr, _, store = manager(roots, tmp_path)
    await mgr.load("one", f"file://{roots}/a1")
    await mgr.load("two", f"file://{roots}/a2")
    fresh_engine = RecordingEngine()
    restarted = LoraManager(fresh_engine, store, roots=[str(roots)], cache_dir=str(tmp_path / "c"),
                            max_loras=2)
    assert sorted(await restarted.reapply()) == ["one", "two"]
    assert fresh_engine.adapters["two"][0] == store.records["two"].lora_id


def _tar_adapter() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("adapter/adapter_config.json", b'{"r": 8}'),
                           ("adapter/adapter_model.safetensors", b"w")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_http_download_retries_and_rollback(roots: Path, tmp_path: Path, aiohttp_port: int) -> None:
    hits = {"flaky": 0}

    async def flaky(_: web.Request) -> web.Response:
        hits["flaky"] += 1
        if hits["flaky"] < 3:
            return web.Response(status=503)
        return web.Response(body=_tar_adapter())

    async def files(req: web.Request) -> web.Response:
        return web.Response(body=b'{"r": 8}' if req.match_info["f"] == "adapter_config.json" else b"w")

    app = web.Application()
    app.router.add_get("/flaky.tar.gz", flaky)
    app.router.add_get("/plain/{f}", files)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", aiohttp_port).start()
    base = f"http://127.0.0.1:{aiohttp_port}"
    try:
        mgr, eng, _ = manager(roots, tmp_path, max_loras=4,
                              fetch=lora_source.FetchPolicy(allow_urls=(f"127.0.0.1:{aiohttp_port}",)))
        info, _ = await mgr.load("net", f"{base}/flaky.tar.gz")
        assert hits["flaky"] == 3 and (Path(info.path) / "adapter_config.json").exists()
        info2, _ = await mgr.load("plain", f"{base}/plain")
        assert (Path(info2.path) / "adapter_model.safetensors").read_bytes() == b"w"
        with pytest.raises(NotFound):
            await mgr.load("missing", f"{base}/missing.tar.gz")
        eng.fail_add = True
        with pytest.raises(RuntimeError):
            await mgr.load("dropme", f"{base}/plain/")  # same files, other URI → new download dir
        assert not lora_source.cache_dir_for(f"{base}/plain/", str(tmp_path / "cache")).exists()
    finally:
        await runner.cleanup()


async def test_http_unreachable_gives_typed_error(tmp_path: Path, aiohttp_port: int) -> None:
    with pytest.raises(RemoteError, match="after 2 attempts"):
        await lora_source.download(f"http://127.0.0.1:{aiohttp_port}/x.tgz", str(tmp_path),
                                   lora_source.FetchPolicy(allow_urls=(f"127.0.0.1:{aiohttp_port}",)), attempts=2)


@pytest.fixture
def aiohttp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
