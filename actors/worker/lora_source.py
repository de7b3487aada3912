"""Resolve a LoRA adapter URI to a local directory.

``file://`` adapters must live under a configured root: the raw path may not contain ``..`` and the
resolved path (symlinks followed) must stay inside a root, so a topology can safely let operators
load adapters by path over NATS. ``http(s)://`` adapters are downloaded with retries into a cache
directory keyed by the URI's digest: either an archive (.tar.gz/.tgz/.tar/.zip) or a base URL under
which ``adapter_config.json`` and ``adapter_model.safetensors`` live.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import tarfile
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from bus.errors import BadRequest, NotFound, RemoteError

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")


class _Retryable(Exception):
    """A download failure worth retrying (connection error, 5xx)."""


def _check_adapter_dir(path: Path) -> Path:
    if not (path / "adapter_config.json").is_file():
        raise NotFound(f"no adapter found at {path} (adapter_config.json missing)")
    return path


def resolve_file_uri(uri: str, roots: list[str]) -> Path:
    parsed = urlparse(uri)
    raw = unquote(parsed.path)
    if parsed.netloc not in ("", "localhost"):
        raise BadRequest(f"file URI must be local: {uri!r}")
    if ".." in Path(raw).parts:
        raise BadRequest(f"path traversal rejected in {uri!r}")
    if not roots:
        raise BadRequest("file:// adapters are disabled: no lora.roots configured for this pool")
    real = Path(os.path.realpath(raw))
    for root in roots:
        real_root = Path(os.path.realpath(os.path.expanduser(root)))
        if real == real_root or real_root in real.parents:
            return _check_adapter_dir(real)
    raise BadRequest(f"adapter path {raw!r} is outside the allowed roots (symlinks are resolved)")


def cache_dir_for(uri: str, cache_root: str) -> Path:
    return Path(os.path.expanduser(cache_root)) / hashlib.sha256(uri.encode()).hexdigest()[:32]


async def _get(session: aiohttp.ClientSession, url: str) -> bytes:
    try:
        async with session.get(url) as resp:
            if resp.status >= 500:
                raise _Retryable(f"HTTP {resp.status} for {url}")
            if resp.status == 404:
                raise NotFound(f"adapter download failed: HTTP 404 for {url}")
            if resp.status >= 400:
                raise RemoteError(f"adapter download failed: HTTP {resp.status} for {url}", 502)
            return await resp.read()
    except (TimeoutError, aiohttp.ClientConnectionError) as e:
        raise _Retryable(f"{type(e).__name__} for {url}: {e}") from e


def _extract(data: bytes, name: str, dest: Path) -> None:
    def safe(member_name: str) -> bool:
        return not (member_name.startswith("/") or ".." in Path(member_name).parts)

    if name.endswith(".zip"):
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for m in zf.namelist():
                if not safe(m):
                    raise BadRequest(f"unsafe member {m!r} in adapter archive")
            zf.extractall(dest)
    else:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            for m in tf.getmembers():
                if not safe(m.name) or m.issym() or m.islnk():
                    raise BadRequest(f"unsafe member {m.name!r} in adapter archive")
            tf.extractall(dest, filter="data")
    # An archive holding one top-level folder: use that folder.
    if not (dest / "adapter_config.json").exists():
        subdirs = [p for p in dest.iterdir() if p.is_dir()]
        if len(subdirs) == 1 and (subdirs[0] / "adapter_config.json").exists():
            for p in subdirs[0].iterdir():
                p.rename(dest / p.name)
            subdirs[0].rmdir()


async def download(uri: str, cache_root: str, attempts: int = 4, timeout: float = 60.0) -> tuple[Path, bool]:
    """Download an http(s) adapter; returns (dir, created) where created says we made the dir."""
    dest = cache_dir_for(uri, cache_root)
    if (dest / "adapter_config.json").is_file():
        return dest, False
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async for attempt in AsyncRetrying(retry=retry_if_exception_type(_Retryable),
                                               stop=stop_after_attempt(attempts),
                                               wait=wait_exponential_jitter(multiplier=0.2, max=5.0),
                                               reraise=True):
                with attempt:
                    path = urlparse(uri).path
                    if path.endswith(_ARCHIVES):
                        _extract(await _get(session, uri), path, tmp)
                    else:
                        base = uri.rstrip("/")
                        for fname in ADAPTER_FILES:
                            (tmp / fname).write_bytes(await _get(session, f"{base}/{fname}"))
        _check_adapter_dir(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except _Retryable as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RemoteError(f"adapter download failed after {attempts} attempts: {e}", 502) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("downloaded LoRA adapter %s into %s", uri, dest)
    return dest, True


async def resolve(uri: str, roots: list[str], cache_root: str) -> tuple[Path, bool]:
    """Local adapter dir for ``uri`` and whether it was freshly created (so rollback removes it)."""
    scheme = urlparse(uri).scheme
    if scheme == "file":
        return resolve_file_uri(uri, roots), False
    if scheme in ("http", "https"):
        return await download(uri, cache_root)
    raise BadRequest(f"unsupported adapter URI scheme {scheme!r}: use file:// or http(s)://")
