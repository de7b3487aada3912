"""Resolve a LoRA adapter URI to a local directory.

``file://`` adapters must live under a configured root: the raw path may not contain ``..`` and the
resolved path (symlinks followed) must stay inside a root, so a topology can safely let operators
load adapters by path over NATS. ``http(s)://`` adapters are downloaded with retries into a cache
directory keyed by the URI's digest: either an archive (.tar.gz/.tgz/.tar/.zip) or a base URL under
which ``adapter_config.json`` and ``adapter_model.safetensors`` live.

Outbound fetches follow the pool's ``lora`` settings (``FetchPolicy``), because the URI comes from a
NATS message: a URL is requested only if ``allow_urls`` admits it, checked before any DNS lookup or
connection (the rule is lora_urls.py, pure); redirects are followed by hand (at most ``MAX_REDIRECTS``), each
target checked the same way; an adapter's files together may not exceed ``max_download_bytes``
(bodies are streamed and counted, archives' declared member sizes too); the whole download, all
attempts included, is bounded by ``download_timeout``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter
from yarl import URL

from actors.worker.lora_urls import parse_allow_entry, shown, url_refusal
from bus.errors import BadRequest, Forbidden, NotFound, PayloadTooLarge, RemoteError, RequestTimeout

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_REDIRECTS = 5
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 1 << 16


class _Retryable(Exception):
    """A download failure worth retrying (connection error, 5xx)."""


@dataclass(frozen=True)
class FetchPolicy:
    """What one pool's LoRA manager may download (``pools.<pool>.lora``); the default fetches nothing."""

    allow_urls: tuple[str, ...] = ()
    max_bytes: int = 4 << 30
    timeout: float = 600.0
    pool: str = "<pool>"

    def __post_init__(self) -> None:
        for raw in self.allow_urls:
            if parse_allow_entry(raw) is None:
                log.warning("%s: ignoring malformed entry %r (a host, host:port or http(s) URL prefix; "
                            "no wildcards)", self.setting, raw)

    @property
    def setting(self) -> str:
        return f"pools.{self.pool}.lora.allow_urls"

    def check(self, url: str, redirected_from: str | None = None) -> URL:
        """The URL to request, or ``Forbidden`` naming it and the setting. No DNS lookup, no connection."""
        reason = url_refusal(url, self.allow_urls)
        if reason is None:
            return URL(url)
        via = f" (redirected from {shown(redirected_from)})" if redirected_from else ""
        what = f"refusing to fetch LoRA adapter URL {shown(url)}{via}"
        if not self.allow_urls:
            raise Forbidden(f"{what}: http(s) adapters are disabled on this pool ({self.setting} is empty); "
                            f"to allow it, add its host or a URL prefix to {self.setting}")
        if reason.startswith("no allow_urls entry"):
            raise Forbidden(f"{what}: not allowed by {self.setting} (no entry admits its host, port and path)")
        raise Forbidden(f"{what}: {reason} ({self.setting})")


_DENY_ALL = FetchPolicy()


# --- file:// -----------------------------------------------------------------------------------------
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


# --- http(s):// --------------------------------------------------------------------------------------
def cache_dir_for(uri: str, cache_root: str) -> Path:
    return Path(os.path.expanduser(cache_root)) / hashlib.sha256(uri.encode()).hexdigest()[:32]


class _Budget:
    """Bytes one adapter may still take (all its files together)."""

    def __init__(self, uri: str, policy: FetchPolicy) -> None:
        self.uri, self.limit, self.pool, self.used = uri, policy.max_bytes, policy.pool, 0

    def too_large(self, what: str) -> PayloadTooLarge:
        return PayloadTooLarge(f"LoRA adapter {shown(self.uri)} is too large: {what} exceeds "
                               f"pools.{self.pool}.lora.max_download_bytes ({self.limit} bytes)")

    def expect(self, n: int | None) -> None:
        if n is not None and self.used + n > self.limit:
            raise self.too_large(f"Content-Length {n}" + (f" after {self.used} bytes" if self.used else ""))

    def add(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise self.too_large("its download")


async def _fetch(session: aiohttp.ClientSession, url: str, out: Path, budget: _Budget,
                 policy: FetchPolicy) -> None:
    """GET ``url`` into ``out``, following allowed redirects by hand and counting bytes."""
    current = policy.check(url)
    for _ in range(MAX_REDIRECTS + 1):
        try:
            async with session.get(current, allow_redirects=False) as resp:
                if resp.status in _REDIRECT_STATUSES:
                    location = resp.headers.get(aiohttp.hdrs.LOCATION)
                    try:
                        target = current.join(URL(location or ""))
                    except ValueError:
                        target = None
                    if not location or target is None:
                        raise RemoteError(f"adapter download failed: HTTP {resp.status} from {current} "
                                          "without a usable Location", 502)
                    current = policy.check(str(target), redirected_from=str(current))
                    continue
                if resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status} for {current}")
                if resp.status == 404:
                    raise NotFound(f"adapter download failed: HTTP 404 for {current}")
                if not 200 <= resp.status < 300:
                    raise RemoteError(f"adapter download failed: HTTP {resp.status} for {current}", 502)
                budget.expect(resp.content_length)
                with open(out, "wb") as f:
                    async for chunk in resp.content.iter_chunked(_CHUNK):
                        budget.add(len(chunk))
                        f.write(chunk)
                return
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise _Retryable(f"{type(e).__name__} for {current}: {e}") from e
        except aiohttp.ClientError as e:
            raise RemoteError(f"adapter download failed: {type(e).__name__} for {current}: {e}", 502) from e
    raise RemoteError(f"adapter download failed: more than {MAX_REDIRECTS} redirects from {shown(url)}", 502)


def _extract(archive: Path, name: str, dest: Path, budget: _Budget) -> None:
    def safe(member_name: str) -> bool:
        return not (member_name.startswith("/") or ".." in Path(member_name).parts)

    if name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for m in zf.namelist():
                if not safe(m):
                    raise BadRequest(f"unsafe member {m!r} in adapter archive")
            if sum(i.file_size for i in zf.infolist()) > budget.limit:
                raise budget.too_large("its unpacked size")
            zf.extractall(dest)
    else:
        with tarfile.open(archive) as tf:
            members = tf.getmembers()
            for m in members:
                if not safe(m.name) or m.issym() or m.islnk():
                    raise BadRequest(f"unsafe member {m.name!r} in adapter archive")
            if sum(m.size for m in members if m.isfile()) > budget.limit:
                raise budget.too_large("its unpacked size")
            tf.extractall(dest, filter="data")
    # An archive holding one top-level folder: use that folder.
    if not (dest / "adapter_config.json").exists():
        subdirs = [p for p in dest.iterdir() if p.is_dir()]
        if len(subdirs) == 1 and (subdirs[0] / "adapter_config.json").exists():
            for p in subdirs[0].iterdir():
                p.rename(dest / p.name)
            subdirs[0].rmdir()


async def _download_into(uri: str, tmp: Path, archive: Path, policy: FetchPolicy, attempts: int,
                         stall_timeout: float) -> None:
    # No total per request: download_timeout bounds the whole adapter; these catch a dead peer.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=stall_timeout, sock_read=stall_timeout)
    path = urlparse(uri).path
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async for attempt in AsyncRetrying(retry=retry_if_exception_type(_Retryable),
                                           stop=stop_after_attempt(attempts),
                                           wait=wait_exponential_jitter(multiplier=0.2, max=5.0),
                                           reraise=True):
            with attempt:
                budget = _Budget(uri, policy)  # every attempt downloads every file again
                if path.endswith(_ARCHIVES):
                    await _fetch(session, uri, archive, budget, policy)
                    _extract(archive, path, tmp, budget)
                    archive.unlink()
                else:
                    base = uri.rstrip("/")
                    for fname in ADAPTER_FILES:
                        await _fetch(session, f"{base}/{fname}", tmp / fname, budget, policy)


async def download(uri: str, cache_root: str, policy: FetchPolicy = _DENY_ALL, attempts: int = 4,
                   stall_timeout: float = 60.0) -> tuple[Path, bool]:
    """Download an http(s) adapter; returns (dir, created) where created says we made the dir.

    ``policy`` is checked first (no connection, no DNS lookup, no cache look-up for a refused URL).
    """
    policy.check(uri)
    dest = cache_dir_for(uri, cache_root)
    if (dest / "adapter_config.json").is_file():
        return dest, False
    tmp = dest.with_name(dest.name + ".part")
    archive = dest.with_name(dest.name + ".part-archive")
    shutil.rmtree(tmp, ignore_errors=True)
    archive.unlink(missing_ok=True)
    tmp.mkdir(parents=True)
    deadline = asyncio.timeout(policy.timeout)
    try:
        try:
            async with deadline:
                await _download_into(uri, tmp, archive, policy, attempts, stall_timeout)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise RequestTimeout(f"LoRA adapter download from {shown(uri)} did not finish within "
                                 f"pools.{policy.pool}.lora.download_timeout ({policy.timeout:g} s)") from None
        _check_adapter_dir(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except _Retryable as e:
        raise RemoteError(f"adapter download failed after {attempts} attempts: {e}", 502) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        archive.unlink(missing_ok=True)
    log.info("downloaded LoRA adapter %s into %s", shown(uri), dest)
    return dest, True


async def resolve(uri: str, roots: list[str], cache_root: str,
                  policy: FetchPolicy = _DENY_ALL) -> tuple[Path, bool]:
    """Local adapter dir for ``uri`` and whether it was freshly created (so rollback removes it)."""
    scheme = urlparse(uri).scheme
    if scheme == "file":
        return resolve_file_uri(uri, roots), False
    if scheme in ("http", "https"):
        return await download(uri, cache_root, policy)
    raise BadRequest(f"unsupported adapter URI scheme {scheme!r}: use file:// or http(s)://")
