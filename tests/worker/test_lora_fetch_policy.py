"""Outbound LoRA fetches only where pools.<pool>.lora allows (SSRF): the allow-list (pure), and real local
HTTP servers / raw TCP listeners showing that refused URLs and redirects are never connected to, and
that size and time caps end downloads with typed errors; the refusal over NATS on a real worker."""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import socket
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from actors.worker import lora_source
from actors.worker.lora_actor import fetch_policy
from actors.worker.lora_source import FetchPolicy
from actors.worker.lora_urls import parse_allow_entry, url_allowed, url_refusal
from bus import rpc
from bus.context import open_context
from bus.errors import Forbidden, PayloadTooLarge, RemoteError, RequestTimeout
from config.topology import LoraConfig

CONFIG = b'{"peft_type": "LORA", "r": 8}'
WEIGHTS = b"weights"


# --- the allow-list, pure ---------------------------------------------------------------------------
@pytest.mark.parametrize("url", [
    "http://hub.example.com/a", "https://hub.example.com/a", "http://HUB.Example.COM/a",
    "http://hub.example.com./a", "http://hub.example.com:80/a", "https://hub.example.com:443/loras/x.tgz",
])
def test_host_entry_admits_its_host_on_default_ports(url: str) -> None:
    assert url_allowed(url, ["hub.example.com"])
    assert url_allowed(url, ["HUB.example.com."])  # the entry is normalised the same way


@pytest.mark.parametrize("url", [
    "http://hub.example.com:8080/a",  # no port in the entry: the scheme's default port only
    "http://hub.example.com:443/a",  # https's port under http is not http's default
    "https://hub.example.com:80/a",
    "http://evil.hub.example.com/a", "http://hub.example.com.evil.net/a", "http://xhub.example.com/a",
    "http://other.example.com/a", "http://127.0.0.1/a", "http://169.254.169.254/latest/meta-data/",
])
def test_host_entry_refuses_other_hosts_and_ports(url: str) -> None:
    assert not url_allowed(url, ["hub.example.com"])


def test_host_port_entry() -> None:
    allow = ["10.0.0.5:8080", "[::1]:9000"]
    assert url_allowed("http://10.0.0.5:8080/a", allow)
    assert url_allowed("https://10.0.0.5:8080/a", allow)
    assert url_allowed("http://[::1]:9000/a", allow)
    for url in ("http://10.0.0.5/a", "http://10.0.0.5:8081/a", "http://10.0.0.6:8080/a", "http://[::1]/a",
                "http://[::2]:9000/a"):
        assert not url_allowed(url, allow), url


@pytest.mark.parametrize("entry", ["https://hub.example.com/loras", "https://hub.example.com/loras/",
                                   "HTTPS://Hub.Example.com:443/loras/"])
def test_prefix_entry_segment_boundary(entry: str) -> None:
    allow = [entry]
    for ok in ("https://hub.example.com/loras", "https://hub.example.com/loras/",
               "https://hub.example.com/loras/a", "https://hub.example.com/loras/a/b.tar.gz",
               "https://HUB.example.com./loras/a"):
        assert url_allowed(ok, allow), ok
    for bad in ("https://hub.example.com/lorasX", "https://hub.example.com/loras-evil/a",
                "https://hub.example.com/lora", "https://hub.example.com/other/loras/a",
                "https://hub.example.com/", "http://hub.example.com/loras/a",  # scheme
                "https://hub.example.com:8443/loras/a",  # port
                "https://evil.example.com/loras/a",
                "https://hub.example.com/loras%2F..%2Fadmin", "https://hub.example.com/loras%2Fx"):
        assert not url_allowed(bad, allow), bad


def test_prefix_entry_of_a_whole_origin() -> None:
    allow = ["http://127.0.0.1:8080/", "https://hub.example.com"]
    assert url_allowed("http://127.0.0.1:8080/anything/x.tgz", allow)
    assert url_allowed("https://hub.example.com/a", allow)
    assert not url_allowed("http://127.0.0.1:8081/a", allow)
    assert not url_allowed("http://hub.example.com/a", allow)  # the prefix names https


@pytest.mark.parametrize("url", [
    "http://user@hub.example.com/a", "http://user:pw@hub.example.com/a", "http://:pw@hub.example.com/a",
    "https://hub.example.com/loras/../admin", "https://hub.example.com/loras/a/..",
    "https://hub.example.com/loras/%2e%2e/admin", "https://hub.example.com/loras/%2E%2E/admin",
    "https://hub.example.com/loras/.%2e/admin", "https://hub.example.com/loras/%252e%252e/admin",
    "https://hub.example.com/loras/..;/admin", "https://hub.example.com/loras/..%5cadmin",
    "https://hub.example.com/loras\\..\\admin", "https://hub.example.com/loras/a b",
    "https://hub.example.com/loras/a\n", "ftp://hub.example.com/loras/a", "file:///etc/passwd",
    "http:///loras/a", "https://hub.example.com:99999/loras/a",
])
def test_refused_url_shapes_even_when_the_host_is_listed(url: str) -> None:
    allow = ["hub.example.com", "https://hub.example.com/loras"]
    assert not url_allowed(url, allow)
    # ... and the same path without the trick is admitted, so the refusal is about the trick.
    assert url_allowed("https://hub.example.com/loras/admin", allow)


def test_reasons() -> None:
    assert "disabled" in url_refusal("https://hub.example.com/a", [])
    assert "credentials" in url_refusal("http://u@hub.example.com/a", ["hub.example.com"])
    assert "'..'" in url_refusal("http://hub.example.com/%2e%2e/a", ["hub.example.com"])
    assert "no allow_urls entry" in url_refusal("http://x.example.com/a", ["hub.example.com"])


@pytest.mark.parametrize("entry", ["*.example.com", "hub.example.com/loras", "user@hub.example.com",
                                   "", "  ", "ftp://hub.example.com/", "https://hub.example.com/a?x=1",
                                   "https://u@hub.example.com/", "hub.example.com:99999"])
def test_malformed_entries_admit_nothing(entry: str) -> None:
    for url in ("http://hub.example.com/loras/a", "https://hub.example.com/a", "http://a.example.com/",
                "http://*.example.com/"):
        assert not url_allowed(url, [entry]), (entry, url)
    assert parse_allow_entry(entry) is None


def test_forbidden_messages_name_url_and_setting() -> None:
    with pytest.raises(Forbidden) as e:
        FetchPolicy(pool="agg").check("http://169.254.169.254/latest")
    msg = str(e.value)
    assert "http://169.254.169.254/latest" in msg and "disabled" in msg and "pools.agg.lora.allow_urls" in msg
    assert e.value.code == 403 and e.value.kind == "permission_error"
    with pytest.raises(Forbidden, match=r"http://127\.0\.0\.1:1/x.*not allowed by pools\.gpu\.lora\.allow_urls"):
        FetchPolicy(allow_urls=("hub.example.com",), pool="gpu").check("http://127.0.0.1:1/x")
    with pytest.raises(Forbidden, match="credentials") as e:
        FetchPolicy(allow_urls=("hub.example.com",)).check("http://alice:s3cret@hub.example.com/x")
    assert "s3cret" not in str(e.value)
    assert str(FetchPolicy(allow_urls=("hub.example.com",)).check("http://hub.example.com/x")) == \
        "http://hub.example.com/x"


def test_policy_from_topology_config() -> None:
    p = fetch_policy(LoraConfig(allow_urls=["hub.example.com"], max_download_bytes=123, download_timeout=4.5),
                     "gpu")
    assert p == FetchPolicy(allow_urls=("hub.example.com",), max_bytes=123, timeout=4.5, pool="gpu")
    assert fetch_policy(LoraConfig(), "agg").allow_urls == ()  # the default fetches nothing


# --- real servers --------------------------------------------------------------------------------------
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Site:
    """A real aiohttp server on 127.0.0.1 (free port) that records every request it gets."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.app = web.Application(middlewares=[self._record])
        self.runner: web.AppRunner | None = None
        self.port = 0

    @web.middleware
    async def _record(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.requests.append(request.path_qs)
        return await handler(request)

    def route(self, path: str, handler: Handler) -> Site:
        self.app.router.add_get(path, handler)
        return self

    def adapter(self, prefix: str, config: bytes = CONFIG, weights: bytes = WEIGHTS) -> Site:
        """``prefix``/adapter_config.json and ``prefix``/adapter_model.safetensors."""
        self.route(f"{prefix}/adapter_config.json", body(config))
        return self.route(f"{prefix}/adapter_model.safetensors", body(weights))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Site:
        self.runner = web.AppRunner(self.app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self


def body(data: bytes) -> Handler:
    async def handler(_r: web.Request) -> web.Response:
        return web.Response(body=data)

    return handler


def redirect(location: str, status: int = 302) -> Handler:
    async def handler(_r: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": location})

    return handler


class Listener:
    """A raw TCP listener on 127.0.0.1 that counts the connections it accepts (and closes them)."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _accept(self, _r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        w.close()

    async def start(self) -> Listener:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self


class Servers:
    def __init__(self) -> None:
        self.sites: list[Site] = []
        self.listeners: list[Listener] = []

    async def site(self) -> Site:
        self.sites.append(Site())
        return self.sites[-1]

    async def listener(self) -> Listener:
        self.listeners.append(await Listener().start())
        return self.listeners[-1]

    async def close(self) -> None:
        for s in self.sites:
            if s.runner is not None:
                await s.runner.cleanup()
        for li in self.listeners:
            assert li.server is not None
            li.server.close()
            await li.server.wait_closed()


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        await s.close()


def allow(*entries: str, **kw: float) -> FetchPolicy:
    return FetchPolicy(allow_urls=entries, pool="agg", **kw)  # type: ignore[arg-type]


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def tar_gz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_empty_allow_list_refuses_without_any_connection(servers: Servers, tmp_path: Path) -> None:
    site = await (await servers.site()).adapter("/loras/a").start()
    raw = await servers.listener()
    cache = tmp_path / "cache"
    for url in (f"{site.url}/loras/a", f"http://127.0.0.1:{raw.port}/x.tgz",
                f"http://localhost:{raw.port}/x", "http://169.254.169.254/latest/meta-data/"):
        with pytest.raises(Forbidden, match="disabled.*pools.agg.lora.allow_urls"):
            await lora_source.download(url, str(cache), FetchPolicy(pool="agg"))
        # the manager's path (resolve) defaults to the same: nothing is fetched
        with pytest.raises(Forbidden):
            await lora_source.resolve(url, [], str(cache))
    await asyncio.sleep(0.1)
    assert site.requests == [] and raw.connections == 0
    assert leftovers(cache) == []
    # Control: the same listener does count connections once its address is allowed (aiohttp itself
    # retries a GET once on a dropped connection, hence "at least").
    with pytest.raises(RemoteError, match="after 1 attempts"):
        await lora_source.download(f"http://127.0.0.1:{raw.port}/x.tgz", str(cache), allow(f"127.0.0.1:{raw.port}"),
                                   attempts=1)
    assert raw.connections >= 1 and leftovers(cache) == []


async def test_host_not_on_the_list_refused_without_any_connection(servers: Servers, tmp_path: Path) -> None:
    site = await (await servers.site()).adapter("/loras/a").start()
    raw = await servers.listener()
    policy = allow(f"127.0.0.1:{site.port}", f"{site.url}/loras/")
    for url in (f"http://127.0.0.1:{raw.port}/loras/a",  # listed host, other port
                f"http://localhost:{site.port}/loras/a",  # another name for the listed host
                "http://127.0.0.1/loras/a",  # the entry names a port: default port refused
                f"http://user@127.0.0.1:{site.port}/loras/a",
                f"{site.url}/loras/%2e%2e/loras/a"):
        with pytest.raises(Forbidden, match="refusing to fetch LoRA adapter URL"):
            await lora_source.download(url, str(tmp_path / "cache"), policy)
    await asyncio.sleep(0.1)
    assert raw.connections == 0 and site.requests == []
    assert leftovers(tmp_path / "cache") == []


async def test_refused_host_is_not_even_resolved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    looked_up: list[str] = []

    def getaddrinfo(host, *_a, **_kw):  # noqa: ANN001, ANN202 - socket.getaddrinfo's signature
        looked_up.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "test: no DNS here")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(Forbidden):
        await lora_source.download("http://adapters.invalid/a", str(tmp_path), allow("hub.invalid"), attempts=1)
    assert looked_up == []
    # Control: an allowed name is resolved (and fails here), so the recorder above does see lookups.
    with pytest.raises(RemoteError):
        await lora_source.download("http://hub.invalid/a", str(tmp_path), allow("hub.invalid"), attempts=1)
    assert looked_up == ["hub.invalid"]


async def test_allowed_host_downloads_adapter_and_caches_it(servers: Servers, tmp_path: Path) -> None:
    archive = tar_gz({"a/adapter_config.json": CONFIG, "a/adapter_model.safetensors": WEIGHTS})
    site = await (await servers.site()).adapter("/loras/plain").route(
        "/loras/a.tar.gz", body(archive)).start()
    cache = str(tmp_path / "cache")
    for policy in (allow(f"127.0.0.1:{site.port}"), allow(f"{site.url}/loras"), allow(f"{site.url}/loras/")):
        path, created = await lora_source.download(f"{site.url}/loras/plain", cache, policy)
        assert (path / "adapter_config.json").read_bytes() == CONFIG
        assert (path / "adapter_model.safetensors").read_bytes() == WEIGHTS
        path2, _ = await lora_source.download(f"{site.url}/loras/a.tar.gz", cache, policy)
        assert (path2 / "adapter_model.safetensors").read_bytes() == WEIGHTS
        if created:  # first round: fetched; later rounds are cache hits
            assert site.requests == ["/loras/plain/adapter_config.json", "/loras/plain/adapter_model.safetensors",
                                     "/loras/a.tar.gz"]
    assert len(site.requests) == 3
    assert sorted(leftovers(Path(cache))) == sorted([path.name, path2.name])  # no .part left over


async def test_prefix_boundary_and_cache_hits_need_the_list_too(servers: Servers, tmp_path: Path) -> None:
    site = await (await servers.site()).adapter("/loras/a").adapter("/lorasX/a").start()
    cache = str(tmp_path / "cache")
    await lora_source.download(f"{site.url}/loras/a", cache, allow(f"{site.url}/loras"))
    n = len(site.requests)
    with pytest.raises(Forbidden):
        await lora_source.download(f"{site.url}/lorasX/a", cache, allow(f"{site.url}/loras"))
    assert len(site.requests) == n
    # an adapter cached while it was allowed is not served once the list no longer admits it
    with pytest.raises(Forbidden):
        await lora_source.download(f"{site.url}/loras/a", cache, allow(f"{site.url}/other"))


async def test_redirects_within_the_list_are_followed(servers: Servers, tmp_path: Path) -> None:
    archive = tar_gz({"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS})
    b = await (await servers.site()).route("/store/a.tar.gz", body(archive)).start()
    a = await servers.site()
    a.route("/loras/a.tar.gz", redirect("../loras/hop1", 302))  # relative Location
    a.route("/loras/hop1", redirect(f"{b.url}/store/a.tar.gz", 307))  # absolute, other server
    await a.start()
    path, created = await lora_source.download(f"{a.url}/loras/a.tar.gz", str(tmp_path),
                                               allow(f"{a.url}/loras/", f"127.0.0.1:{b.port}"))
    assert created and (path / "adapter_config.json").read_bytes() == CONFIG
    assert a.requests == ["/loras/a.tar.gz", "/loras/hop1"] and b.requests == ["/store/a.tar.gz"]


async def test_redirect_off_the_list_is_refused_before_connecting(servers: Servers, tmp_path: Path) -> None:
    raw = await servers.listener()
    off = await (await servers.site()).adapter("/x").start()
    a = await servers.site()
    a.route("/loras/raw/adapter_config.json", redirect(f"http://127.0.0.1:{raw.port}/x"))
    a.route("/loras/off/adapter_config.json", redirect(f"{off.url}/x/adapter_config.json", 301))
    a.route("/loras/meta/adapter_config.json", redirect("http://169.254.169.254/latest/", 303))
    a.route("/loras/out/adapter_config.json", redirect("/private/adapter_config.json", 308))
    a.route("/loras/file/adapter_config.json", redirect("file:///etc/passwd"))
    a.route("/private/adapter_config.json", body(CONFIG))
    await a.start()
    cache = tmp_path / "cache"
    for name in ("raw", "off", "meta", "out", "file"):
        with pytest.raises(Forbidden, match=f"redirected from {a.url}/loras/{name}/adapter_config.json"):
            await lora_source.download(f"{a.url}/loras/{name}", str(cache), allow(f"{a.url}/loras"))
    await asyncio.sleep(0.1)
    assert raw.connections == 0 and off.requests == []
    assert "/private/adapter_config.json" not in a.requests
    assert leftovers(cache) == []


async def test_too_many_redirects(servers: Servers, tmp_path: Path) -> None:
    site = await (await servers.site()).route("/loop.tgz", redirect("/loop.tgz")).start()
    with pytest.raises(RemoteError, match="more than 5 redirects") as e:
        await lora_source.download(f"{site.url}/loop.tgz", str(tmp_path), allow(f"127.0.0.1:{site.port}"))
    assert e.value.code == 502
    assert site.requests == ["/loop.tgz"] * 6  # the first request and 5 followed redirects
    assert leftovers(tmp_path) == []


def stalling_after(declared: int, first: bytes) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = declared
        await resp.prepare(request)
        await resp.write(first)
        await asyncio.sleep(30)
        return resp

    return handler


async def test_size_cap_from_content_length(servers: Servers, tmp_path: Path) -> None:
    # Declares 1 MiB, sends 10 bytes, then stalls: only a Content-Length check ends this quickly (a
    # reader would wait for the rest until the 10 s download_timeout).
    site = await (await servers.site()).route(
        "/big.tgz", stalling_after(1 << 20, b"x" * 10)).start()
    t0 = time.monotonic()
    with pytest.raises(PayloadTooLarge, match=r"Content-Length 1048576 exceeds pools\.agg\.lora\.max_download_bytes"):
        await lora_source.download(f"{site.url}/big.tgz", str(tmp_path),
                                   allow(f"127.0.0.1:{site.port}", max_bytes=1000, timeout=10.0))
    assert time.monotonic() - t0 < 5.0
    assert leftovers(tmp_path) == []


async def test_size_cap_without_content_length(servers: Servers, tmp_path: Path) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # chunked: no Content-Length
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"z" * 65536)
        except (ConnectionError, RuntimeError):
            return resp

    site = await (await servers.site()).route("/endless.tgz", endless).start()
    t0 = time.monotonic()
    with pytest.raises(PayloadTooLarge, match="max_download_bytes"):
        await lora_source.download(f"{site.url}/endless.tgz", str(tmp_path),
                                   allow(f"127.0.0.1:{site.port}", max_bytes=300_000, timeout=20.0))
    assert time.monotonic() - t0 < 5.0
    assert leftovers(tmp_path) == []


async def test_size_cap_counts_all_files_of_an_adapter(servers: Servers, tmp_path: Path) -> None:
    site = await (await servers.site()).adapter("/a", config=b"{" + b" " * 598 + b"}",
                                                weights=b"w" * 600).start()
    with pytest.raises(PayloadTooLarge):  # 600 + 600 > 1000, each file alone fits
        await lora_source.download(f"{site.url}/a", str(tmp_path), allow(f"127.0.0.1:{site.port}", max_bytes=1000))
    assert leftovers(tmp_path) == []
    path, _ = await lora_source.download(f"{site.url}/a", str(tmp_path),
                                         allow(f"127.0.0.1:{site.port}", max_bytes=1200))
    assert (path / "adapter_model.safetensors").stat().st_size == 600


async def test_size_cap_on_unpacked_archive(servers: Servers, tmp_path: Path) -> None:
    bomb = tar_gz({"adapter_config.json": CONFIG, "adapter_model.safetensors": bytes(2_000_000)})
    assert len(bomb) < 10_000
    site = await (await servers.site()).route("/bomb.tar.gz", body(bomb)).start()
    with pytest.raises(PayloadTooLarge, match="unpacked size"):
        await lora_source.download(f"{site.url}/bomb.tar.gz", str(tmp_path),
                                   allow(f"127.0.0.1:{site.port}", max_bytes=1_000_000))
    assert leftovers(tmp_path) == []
    path, _ = await lora_source.download(f"{site.url}/bomb.tar.gz", str(tmp_path),
                                         allow(f"127.0.0.1:{site.port}", max_bytes=3_000_000))
    assert (path / "adapter_model.safetensors").stat().st_size == 2_000_000


@pytest.mark.parametrize("mode", ["silent", "drip"])
async def test_download_timeout_bounds_the_whole_download(servers: Servers, tmp_path: Path, mode: str) -> None:
    async def silent(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)  # never answers
        return web.Response()

    async def drip(request: web.Request) -> web.StreamResponse:
        # a byte every 50 ms: every read makes progress, so only a bound on the whole download ends it
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(600):
            await resp.write(b"x")
            await asyncio.sleep(0.05)
        return resp

    site = await (await servers.site()).route("/slow.tgz", silent if mode == "silent" else drip).start()
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"did not finish within pools\.agg\.lora\.download_timeout \(1 s\)") as e:
        await lora_source.download(f"{site.url}/slow.tgz", str(tmp_path), allow(f"127.0.0.1:{site.port}", timeout=1.0))
    elapsed = time.monotonic() - t0
    assert 0.9 < elapsed < 5.0, elapsed
    assert e.value.code == 504
    assert leftovers(tmp_path) == []


async def test_retries_on_5xx_still_happen_within_the_policy(servers: Servers, tmp_path: Path) -> None:
    hits = 0

    async def flaky(_r: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        return web.Response(status=503) if hits < 3 else web.Response(body=CONFIG)

    site = await (await servers.site()).route("/a/adapter_config.json", flaky).route(
        "/a/adapter_model.safetensors", body(WEIGHTS)).start()
    path, _ = await lora_source.download(f"{site.url}/a", str(tmp_path), allow(f"127.0.0.1:{site.port}"))
    assert hits == 3 and (path / "adapter_config.json").read_bytes() == CONFIG


# --- over NATS, on a real (mocker) worker --------------------------------------------------------------
async def test_refusal_over_nats_is_a_typed_403(nats_server, servers: Servers, tmp_path: Path) -> None:
    from actors.worker.process import run_worker
    from config.loader import load_topology
    from tests.worker.test_worker_children import engine_instance, write

    raw = await servers.listener()
    site = await (await servers.site()).adapter("/loras/a").start()
    ns = f"w{secrets.token_hex(3)}"
    cache = tmp_path / "lora-cache"
    topo = write(tmp_path, nats_server.url, ns,
                 extra=f'[pools.agg.lora]\nallow_urls = ["{site.url}/loras/"]\ncache_dir = "{cache}"\n',
                 args="enable_lora = true\nmax_loras = 2")
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(load_topology(topo), "agg", 0, stop=stop))
    ctx = await open_context(nats_server.url, ns, "local", "test")
    try:
        inst = await engine_instance(ctx)
        subject = ctx.subjects.worker(inst, "lora.load")
        for _ in range(100):  # the LoRA manager starts after the engine
            try:
                await rpc.request(ctx.nc, ctx.subjects.worker(inst, "lora.list"), {}, timeout=1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.05)
        for url in (f"http://127.0.0.1:{raw.port}/loras/a", "http://169.254.169.254/latest/meta-data/",
                    f"{site.url}/lorasX/a"):
            with pytest.raises(Forbidden) as e:
                await rpc.request(ctx.nc, subject, {"lora_name": "evil", "source": {"uri": url}}, timeout=10)
            assert e.value.code == 403 and url in str(e.value) and "pools.agg.lora.allow_urls" in str(e.value)
        await asyncio.sleep(0.1)
        assert raw.connections == 0 and site.requests == []
        reply = await rpc.request(ctx.nc, subject, {"lora_name": "good", "source": {"uri": f"{site.url}/loras/a"}},
                                  timeout=10)
        assert reply["status"] == "ok"
        assert site.requests == ["/loras/a/adapter_config.json", "/loras/a/adapter_model.safetensors"]
        listed = await rpc.request(ctx.nc, ctx.subjects.worker(inst, "lora.list"), {}, timeout=10)
        assert [a["lora_name"] for a in listed["adapters"]] == ["good"]
        assert json.loads((Path(listed["adapters"][0]["path"]) / "adapter_config.json").read_bytes())["r"] == 8
    finally:
        stop.set()
        assert await asyncio.wait_for(worker, 30) == 0
        await ctx.close()
