"""The images of a chat request (``actors.frontend.media``): data: URLs decoded and checked, http(s)
URLs fetched from a real aiohttp server on 127.0.0.1 only where ``allow_urls`` admits them, every
bad input a 400 naming the part and the setting."""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import io
import json
import socket
import struct
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from PIL import Image
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from actors.frontend.media import load_images, malformed_allow_urls
from actors.worker.lora_urls import shown, url_refusal
from bus.errors import BadRequest
from config.topology import MediaConfig

CAP = 256 << 10  # max_image_bytes in the byte-cap tests


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


PNG = encoded(Image.new("RGB", (64, 48), (200, 10, 10)), "PNG")
JPEG = encoded(Image.new("RGB", (40, 30), (10, 200, 10)), "JPEG")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(*parts: dict) -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header declares w x h (8-bit grey) and whose pixel data is a few bytes: Pillow
    opens it (the header is all ``Image.open`` reads) but decoding it fails (truncated)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


async def refused(messages: list[dict], cfg: MediaConfig, session: aiohttp.ClientSession | None = None) -> str:
    with pytest.raises(BadRequest) as ei:
        await load_images(messages, cfg, session)
    assert ei.value.code == 400 and ei.value.param == "messages"
    return str(ei.value)


# --- data: URLs --------------------------------------------------------------------------------------
async def test_data_urls_png_and_jpeg_in_order() -> None:
    msgs = chat(image(data_url(PNG)), {"type": "text", "text": "and"}, image(data_url(JPEG, "image/jpeg")))
    before = copy.deepcopy(msgs)
    out, images = await load_images(msgs, MediaConfig(), None)
    assert msgs == before  # not modified
    assert out[0] == msgs[0]
    assert out[1]["content"] == [{"type": "text", "text": "what is this?"}, {"type": "image"},
                                 {"type": "text", "text": "and"}, {"type": "image"}]
    png, jpeg = images
    assert (png.uuid, png.data, png.width, png.height, png.format) == (hashlib.sha256(PNG).hexdigest(), PNG, 64, 48, "PNG")
    assert (jpeg.uuid, jpeg.width, jpeg.height, jpeg.format) == (hashlib.sha256(JPEG).hexdigest(), 40, 30, "JPEG")
    assert png.image.mode == "RGB" and png.image.getpixel((3, 3)) == (200, 10, 10)  # decoded, loaded


async def test_rgba_becomes_rgb_on_white_and_exif_orientation_applies() -> None:
    """vllm serve's decode: transparency onto white, the EXIF orientation turned into pixels (a
    rotated phone photo is as wide as it looks, which the processor's token count depends on)."""
    rgba = encoded(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    src = Image.new("RGB", (40, 20), (0, 0, 255))
    buf = io.BytesIO()
    src.save(buf, "JPEG", exif=exif)
    _, (clear, rotated) = await load_images(chat(image(data_url(rgba)), image(data_url(buf.getvalue(), "image/jpeg"))),
                                            MediaConfig(), None)
    assert clear.image.mode == "RGB" and clear.image.getpixel((0, 0)) == (255, 255, 255)
    assert (rotated.width, rotated.height) == (20, 40)


async def test_text_only_messages_pass_through() -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "refusal", "refusal": "no"}]}]
    out, images = await load_images(msgs, MediaConfig(), None)
    assert out == msgs and images == []


async def test_parsed_request_and_its_lazy_contents() -> None:
    """Messages as vLLM's ChatCompletionRequest gives them: image parts of the OpenAI shape come as
    dicts; a part that fits no OpenAI type stays a lazy pydantic iterator that fails when read."""
    body = {"model": "m", "messages": chat(image(data_url(PNG)), {"type": "image_url", "image_url": data_url(JPEG)})}
    req = ChatCompletionRequest.model_validate_json(json.dumps(body))
    out, images = await load_images(list(req.messages), MediaConfig(), None)
    assert [i.format for i in images] == ["PNG", "JPEG"] and out[1]["content"][1:] == [{"type": "image"}] * 2
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "image": "x"}]}]
    req = ChatCompletionRequest.model_validate_json(json.dumps(body))
    msg = await refused(list(req.messages), MediaConfig())
    assert msg == ("messages[0].content[1]: content part type 'image' is not supported: "
                   "this server takes text and image parts")


@pytest.mark.parametrize("part", [
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}},
    {"type": "file", "file": {"file_id": "f"}},
    {"type": "image_embeds", "image_embeds": "AAAA"},
])
async def test_other_part_types_are_refused_by_name(part: dict) -> None:
    msg = await refused(chat(part), MediaConfig())
    assert msg == (f"messages[1].content[1]: content part type {part['type']!r} is not supported: "
                   "this server takes text and image parts")


@pytest.mark.parametrize(("url", "words"), [
    ("data:image/png;base64,iVBORw0KGgo*not-base64*", "the data URL's base64 is invalid"),
    ("data:image/png;base64,iVBORw0KGgo*", "the data URL's base64 is invalid"),  # a length base64 can have
    ("data:image/png;base64,iVBORw0KGg", "the data URL's base64 is invalid"),  # bad padding
    (data_url(PNG, "text/plain"), "the data URL's media type is 'text/plain', not image/*"),
    ("data:image/png," + "x" * 10, "a data URL must be data:image/<type>;base64,<data>"),
    ("data:image/png;base64", "a data URL must be data:image/<type>;base64,<data>"),
])
async def test_bad_data_urls(url: str, words: str) -> None:
    assert await refused(chat(image(url)), MediaConfig()) == f"messages[1].content[1]: {words}"


@pytest.mark.parametrize("data", [
    encoded(Image.new("RGB", (8, 8)), "TIFF"),  # Pillow decodes TIFF, but it is not in formats
    b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,  # image/png by its mime, noise inside
    b"GIF89a",
])
async def test_unsupported_or_undecodable_format(data: bytes) -> None:
    msg = await refused(chat(image(data_url(data))), MediaConfig())
    assert "unsupported image format (accepted: PNG, JPEG, WEBP, GIF, BMP; frontend.media.formats)" in msg
    # the same file is decoded once its format is allowed (the TIFF), or still refused (the noise)
    if data.startswith(b"II"):
        _, (tiff,) = await load_images(chat(image(data_url(data))), MediaConfig(formats=["tiff", "PNG"]), None)
        assert tiff.format == "TIFF"


async def test_a_truncated_image_is_a_400() -> None:
    msg = await refused(chat(image(data_url(PNG[: len(PNG) // 2]))), MediaConfig())
    assert msg.startswith("messages[1].content[1]: the image could not be decoded: ")


async def test_too_many_images_before_anything_is_loaded() -> None:
    # the third part is not even valid base64: the count is checked first
    msgs = chat(image(data_url(PNG)), image(data_url(PNG)), image("data:image/png;base64,!!"))
    msg = await refused(msgs, MediaConfig(max_images=2))
    assert msg == "3 images in one request; at most 2 are accepted (frontend.media.max_images)"


async def test_byte_caps_per_image_and_per_request() -> None:
    big = encoded(Image.effect_noise((400, 400), 64).convert("RGB"), "PNG")
    assert len(big) > CAP
    msg = await refused(chat(image(data_url(big))), MediaConfig(max_image_bytes=CAP))
    assert msg == f"messages[1].content[1]: the image exceeds {CAP} bytes (frontend.media.max_image_bytes)"
    # the size read from the base64's length is exact: the cap itself passes, one byte less does not
    _, (ok,) = await load_images(chat(image(data_url(PNG))), MediaConfig(max_image_bytes=len(PNG)), None)
    assert ok.data == PNG
    msg = await refused(chat(image(data_url(PNG))), MediaConfig(max_image_bytes=len(PNG) - 1))
    assert "exceeds" in msg
    # each under its cap, together over the request's
    msg = await refused(chat(image(data_url(PNG)), image(data_url(JPEG))),
                        MediaConfig(max_total_bytes=len(PNG) + len(JPEG) - 1))
    assert msg == (f"messages[1].content[2]: the request's images exceed {len(PNG) + len(JPEG) - 1} bytes "
                   "together (frontend.media.max_total_bytes)")


async def test_pixels_are_checked_from_the_header_before_decoding() -> None:
    """A 9000x9000 PNG header over a few bytes of data: refused for its pixels, so nothing was
    decoded (decoding it fails as truncated, as the second call shows with a higher limit). 9000^2
    stays under Pillow's own warning level, so the message is ours."""
    bomb = png_header_only(9000, 9000)
    msg = await refused(chat(image(data_url(bomb))), MediaConfig())
    assert msg == ("messages[1].content[1]: the image is 9000x9000, over 16777216 pixels "
                   "(frontend.media.max_pixels)")
    msg = await refused(chat(image(data_url(bomb))), MediaConfig(max_pixels=9000 * 9000))
    assert "could not be decoded" in msg
    # over Pillow's hard limit (2 x Image.MAX_IMAGE_PIXELS) with ours set higher: still our 400
    msg = await refused(chat(image(data_url(png_header_only(20000, 20000)))), MediaConfig(max_pixels=10**9))
    assert msg == "messages[1].content[1]: the image is over 1000000000 pixels (frontend.media.max_pixels)"


# --- http(s) URLs --------------------------------------------------------------------------------------
@dataclass
class ImageServer:
    base: str
    host: str  # host:port, an allow_urls entry
    hits: Counter = field(default_factory=Counter)
    inflight: int = 0
    peak: int = 0
    sent: int = 0  # bytes /stream wrote before the client hung up


@pytest.fixture
async def server() -> AsyncIterator[ImageServer]:
    srv = ImageServer("", "")

    async def count(request: web.Request) -> None:
        srv.hits[request.path] += 1

    async def ok(request: web.Request) -> web.Response:
        await count(request)
        return web.Response(body=PNG, content_type="image/png")

    async def numbered(request: web.Request) -> web.Response:
        """A different image per n, served slowly: the concurrency test counts requests in flight."""
        await count(request)
        srv.inflight += 1
        srv.peak = max(srv.peak, srv.inflight)
        try:
            await asyncio.sleep(0.2)
        finally:
            srv.inflight -= 1
        n = int(request.match_info["n"])
        return web.Response(body=encoded(Image.new("RGB", (10 + n, 10)), "PNG"), content_type="image/png")

    async def html(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="text/html")

    async def no_type(request: web.Request) -> web.Response:
        return web.Response(body=PNG, headers={"Content-Type": ""})

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404, text="no")

    async def redirect(request: web.Request) -> web.Response:
        await count(request)
        raise web.HTTPFound("/ok.png")

    async def declared_big(request: web.Request) -> web.Response:
        return web.Response(body=b"\0" * (CAP + 1), content_type="image/png")

    async def stream(request: web.Request) -> web.StreamResponse:
        """Chunked (no Content-Length), four times the cap if the client reads it all."""
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        try:
            for _ in range(4 * CAP // 4096):
                await resp.write(b"\0" * 4096)
                srv.sent += 4096
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        return resp

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(body=PNG, content_type="image/png")

    async def slow_body(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        await resp.write(PNG[:10])
        await asyncio.sleep(30)
        return resp

    app = web.Application()
    app.router.add_get("/ok.png", ok)
    app.router.add_get("/n/{n}.png", numbered)
    app.router.add_get("/page.html", html)
    app.router.add_get("/untyped", no_type)
    app.router.add_get("/missing.png", missing)
    app.router.add_get("/redirect.png", redirect)
    app.router.add_get("/big.png", declared_big)
    app.router.add_get("/stream.png", stream)
    app.router.add_get("/slow.png", slow)
    app.router.add_get("/slow-body.png", slow_body)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    srv.base, srv.host = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
    try:
        yield srv
    finally:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_urls_are_not_fetched_by_default(server: ImageServer, session: aiohttp.ClientSession) -> None:
    msg = await refused(chat(image(server.base + "/ok.png")), MediaConfig(), session)
    assert msg.startswith("messages[1].content[1]: image URLs are not fetched: set frontend.media.allow_urls")
    msg = await refused(chat(image(server.base + "/ok.png")), MediaConfig(allow_urls=["images.example.com"]), session)
    assert msg == (f"messages[1].content[1]: image URL {server.base}/ok.png is refused: no allow_urls entry "
                   "admits its host, port and path (frontend.media.allow_urls)")
    # a prefix entry admits below it only
    cfg = MediaConfig(allow_urls=[server.base + "/n/"])
    assert "is refused" in await refused(chat(image(server.base + "/ok.png")), cfg, session)
    assert server.hits["/ok.png"] == 0


@pytest.mark.parametrize(("url", "scheme"), [("file:///etc/passwd", "file"), ("ftp://127.0.0.1/a.png", "ftp"),
                                              ("gopher://127.0.0.1:70/", "gopher"), ("/ok.png", "relative")])
async def test_other_schemes_are_refused(url: str, scheme: str) -> None:
    msg = await refused(chat(image(url)), MediaConfig(allow_urls=["127.0.0.1"]))
    assert msg == f"messages[1].content[1]: image URLs must be data:, http: or https:, not {scheme!r}"


async def test_an_allowed_url_is_fetched(server: ImageServer, session: aiohttp.ClientSession) -> None:
    cfg = MediaConfig(allow_urls=[server.host])
    out, (img,) = await load_images(chat(image(server.base + "/ok.png")), cfg, session)
    assert (img.uuid, img.data, img.width, img.height) == (hashlib.sha256(PNG).hexdigest(), PNG, 64, 48)
    assert out[1]["content"][1] == {"type": "image"}
    # without a session of the caller's: one of its own, closed after
    _, (again,) = await load_images(chat({"type": "image_url", "image_url": server.base + "/ok.png"}), cfg, None)
    assert again.uuid == img.uuid and server.hits["/ok.png"] == 2


async def test_fetches_are_concurrent_bounded_and_in_order(server: ImageServer, session: aiohttp.ClientSession) -> None:
    cfg = MediaConfig(allow_urls=[server.host], max_concurrent_fetches=2)
    urls = [f"{server.base}/n/{n}.png" for n in range(6)]
    _, images = await load_images(chat(*map(image, urls)), cfg, session)
    assert [i.width for i in images] == [10 + n for n in range(6)]
    assert server.peak == 2


@pytest.mark.parametrize(("path", "words"), [
    ("/missing.png", "HTTP 404"),
    ("/page.html", "its content type is 'text/html', not image/*"),
    ("/untyped", "its content type is 'missing', not image/*"),
    ("/redirect.png", "HTTP 302 redirect to '/ok.png'; redirects are not followed, give the final URL"),
])
async def test_bad_answers(server: ImageServer, session: aiohttp.ClientSession, path: str, words: str) -> None:
    msg = await refused(chat(image(server.base + path)), MediaConfig(allow_urls=[server.host]), session)
    assert msg == f"messages[1].content[1]: could not fetch image URL {server.base}{path}: {words}"
    assert server.hits["/ok.png"] == 0  # the redirect was not followed


async def test_body_caps(server: ImageServer, session: aiohttp.ClientSession) -> None:
    cfg = MediaConfig(allow_urls=[server.host], max_image_bytes=CAP)
    msg = await refused(chat(image(server.base + "/big.png")), cfg, session)
    assert msg == (f"messages[1].content[1]: the image at {server.base}/big.png (Content-Length {CAP + 1}) "
                   f"exceeds {CAP} bytes (frontend.media.max_image_bytes)")
    msg = await refused(chat(image(server.base + "/stream.png")), cfg, session)
    assert msg == (f"messages[1].content[1]: the image at {server.base}/stream.png exceeds {CAP} bytes "
                   "(frontend.media.max_image_bytes)")
    # the request's total counts fetched bodies as they stream (the data URL took its share first)
    cfg = MediaConfig(allow_urls=[server.host], max_total_bytes=CAP)
    msg = await refused(chat(image(data_url(PNG)), image(server.base + "/stream.png")), cfg, session)
    assert msg.endswith(f"the request's images exceed {CAP} bytes together (frontend.media.max_total_bytes)")


async def test_connection_refused(session: aiohttp.ClientSession) -> None:
    with socket.socket() as s:  # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        msg = await refused(chat(image(f"http://127.0.0.1:{port}/a.png")),
                            MediaConfig(allow_urls=[f"127.0.0.1:{port}"]), session)
    assert msg.startswith(f"messages[1].content[1]: could not fetch image URL http://127.0.0.1:{port}/a.png: "
                          "ClientConnectorError: Cannot connect to host 127.0.0.1:")


@pytest.mark.parametrize("path", ["/slow.png", "/slow-body.png"])
async def test_timeout_covers_headers_and_body(server: ImageServer, session: aiohttp.ClientSession, path: str) -> None:
    t0 = time.monotonic()
    msg = await refused(chat(image(server.base + path)), MediaConfig(allow_urls=[server.host], fetch_timeout=0.3), session)
    assert msg == (f"messages[1].content[1]: could not fetch image URL {server.base}{path}: no complete answer "
                   "within 0.3 s (frontend.media.fetch_timeout)")
    assert time.monotonic() - t0 < 10


async def test_a_failure_cancels_the_other_fetches(server: ImageServer, session: aiohttp.ClientSession) -> None:
    t0 = time.monotonic()
    msg = await refused(chat(image(server.base + "/slow.png"), image(server.base + "/missing.png")),
                        MediaConfig(allow_urls=[server.host], fetch_timeout=60), session)
    assert msg.endswith("/missing.png: HTTP 404") and time.monotonic() - t0 < 10
    # the slow fetch was cancelled and awaited, not left running for a request that already failed
    ours = [t for t in asyncio.all_tasks() if "load_images.<locals>.one" in t.get_coro().__qualname__]
    assert ours == []


async def test_checks_come_before_fetches_in_part_order(server: ImageServer, session: aiohttp.ClientSession) -> None:
    """A refused part after a fetchable one: the request fails before anything is fetched."""
    msgs = chat(image(server.base + "/ok.png"), image("file:///etc/passwd"))
    msg = await refused(msgs, MediaConfig(allow_urls=[server.host]), session)
    assert msg.startswith("messages[1].content[2]: image URLs must be") and server.hits["/ok.png"] == 0


async def test_an_unparsable_url_is_a_400_not_a_crash() -> None:
    msg = await refused(chat(image("http://[::1/a.png")), MediaConfig(allow_urls=["127.0.0.1"]))
    assert msg == "messages[1].content[1]: the image URL is malformed"
    # the allow-list rule shared with the LoRA downloads refuses it too (it raised ValueError)
    assert url_refusal("http://[::1/a.png", ["[::1]"]) == "malformed URL (Invalid IPv6 URL)"
    assert shown("http://u:secret@[::1/a.png") == "<malformed URL>"


def test_malformed_allow_urls_are_named() -> None:
    cfg = MediaConfig(allow_urls=["images.example.com", "*.example.com", "https://cdn.example.com/p/", "a b"])
    assert malformed_allow_urls(cfg) == ["*.example.com", "a b"]

