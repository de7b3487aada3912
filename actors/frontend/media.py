"""The images of a chat request: OpenAI ``image_url`` parts loaded, checked and decoded at the
frontend, before any worker sees them (``[frontend.media]``, ``config.topology.MediaConfig``).

An image comes as a ``data:image/...;base64,`` URL or as an http(s) URL. A URL is fetched only when
``allow_urls`` admits it (the rule of the LoRA downloads, ``actors.worker.lora_urls``: judged before
any DNS lookup or connection), with no redirect followed, within ``fetch_timeout``, as ``image/*``,
and its body counted against the byte caps while it streams. A file is decoded only after its
header passed the checks: a format in ``formats`` (no other Pillow decoder is even tried) and at
most ``max_pixels``. Decoding follows ``vllm serve`` (EXIF orientation applied, then RGB on a white
background) and runs off the event loop. Every bad input is a ``BadRequest`` (400) naming the part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pydantic
from PIL import Image
from yarl import URL

from actors.engines.image_decode import to_model_rgb
from actors.worker.lora_urls import parse_allow_entry, shown, url_refusal
from bus.errors import BadRequest
from config.topology import MediaConfig

_TEXT_PARTS = frozenset({"text", "input_text", "refusal"})
# "image_url" ({"url": ...} or the URL itself), "input_image" (the Responses API's spelling) and a
# part with no type but an image_url (vLLM's shorthand)
_IMAGE_PARTS = frozenset({"image_url", "input_image"})
_CHUNK = 1 << 16


@dataclass(frozen=True)
class LoadedImage:
    uuid: str  # sha256 hex of ``data``: the image's id for vLLM's prefix cache, its KV events, the router
    data: bytes  # the file as received (base64-decoded or downloaded)
    width: int  # of ``image``: after the EXIF orientation, as the processor sees it
    height: int
    format: str  # Pillow's name of the file's format ("PNG", "JPEG", "MPO", ...)
    image: Image.Image = field(repr=False, compare=False)  # decoded, RGB, loaded


def media_session() -> aiohttp.ClientSession:
    """A client session for image URLs: no cookie jar (one client's image host must not set cookies
    that later requests of other clients send back) and no proxy from the environment."""
    return aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)


def malformed_allow_urls(cfg: MediaConfig) -> list[str]:
    """``allow_urls`` entries that admit nothing (the loader cannot judge them: the rule lives in a
    higher layer); the frontend logs them at start."""
    return [e for e in cfg.allow_urls if parse_allow_entry(e) is None]


def has_media(messages: Iterable[Any]) -> bool:
    """Whether ``messages`` may hold anything but text: cheap, for the hot path of text chats. A
    content that is neither a string nor a list (pydantic's lazy iterators) counts as "may", since
    reading it would consume it; ``load_images`` then reads it once."""
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return True
        if any(not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS for p in content):
            return True
    return False


async def load_images(messages: list[dict[str, Any]], cfg: MediaConfig,
                      session: aiohttp.ClientSession | None,
                      takes_images: Callable[[], None] | None = None,
                      ) -> tuple[list[dict[str, Any]], list[LoadedImage]]:
    """``messages`` with each image part replaced by ``{"type": "image"}`` (a chat template renders
    it as the model's image placeholder), and the images in the order of those parts. Messages are
    not modified; every non-string content comes back as a list (pydantic gives some as one-shot
    iterators). URLs are fetched with ``session`` (a short-lived one of ``media_session`` if None).
    ``takes_images`` runs once an image part is found, before any image is checked or fetched: a
    model that takes no images is the error to report, and nothing is fetched for it."""
    out: list[dict[str, Any]] = []
    sources: list[tuple[str, str]] = []  # (where, url) per image part
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if content is None or isinstance(content, str):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(_parts(content, f"messages[{i}].content")):
            where = f"messages[{i}].content[{j}]"
            url = _image_url(part, where)
            if url is None:
                parts.append(part)
            else:
                parts.append({"type": "image"})
                sources.append((where, url))
        out.append({**msg, "content": parts})
    if not sources:
        return out, []
    if takes_images is not None:
        takes_images()
    if len(sources) > cfg.max_images:
        raise BadRequest(f"{len(sources)} images in one request; at most {cfg.max_images} are accepted "
                         "(frontend.media.max_images)", param="messages")
    budget = _Budget(cfg)
    # the cheap checks in order, before any fetch: the first bad part is the one reported
    plan = [(where, _data_url(url, where, cfg, budget) if url[:5].lower() == "data:" else _check_url(url, where, cfg))
            for where, url in sources]
    own = session is None and any(isinstance(f, URL) for _, f in plan)
    if own:
        session = media_session()
    sem = asyncio.Semaphore(cfg.max_concurrent_fetches)

    async def one(where: str, f: str | URL) -> LoadedImage:
        if isinstance(f, URL):
            assert session is not None
            async with sem:
                data = await _fetch(session, f, where, cfg, budget)
            return await _decode(data, where, cfg)
        return await _decode(f, where, cfg)

    try:
        return out, await _gather([one(where, f) for where, f in plan])
    finally:
        if own:
            assert session is not None
            await session.close()


async def _gather(coros: list[Any]) -> list[LoadedImage]:
    """All results in order; on the first failure the others are cancelled (no fetch left running
    for a request that already failed) and that failure is raised as itself."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


# --- the parts of a message ----------------------------------------------------------------------
def _parts(content: Iterable[Any], where: str) -> list[dict[str, Any]]:
    """A message's content parts as dicts. pydantic leaves some contents as lazy iterators that
    validate while they are read: a part none of the OpenAI types fits fails here."""
    parts: list[dict[str, Any]] = []
    try:
        for part in content:
            if isinstance(part, pydantic.BaseModel):
                part = part.model_dump(exclude_none=True)
            if not isinstance(part, dict):
                raise BadRequest(f"{where}[{len(parts)}]: a content part must be an object", param="messages")
            parts.append(part)
    except pydantic.ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        raw = first.get("input")
        ptype = raw.get("type") if isinstance(raw, dict) else None
        raise BadRequest(f"{where}[{len(parts)}]: {_unsupported(ptype)}", param="messages") from None
    except TypeError:
        raise BadRequest(f"{where}: expected a string or a list of content parts", param="messages") from None
    return parts


def _unsupported(ptype: object) -> str:
    return f"content part type {ptype!r} is not supported: this server takes text and image parts"


def _image_url(part: dict[str, Any], where: str) -> str | None:
    """The image URL of an image part, None for a text part; any other part is a 400."""
    ptype = part.get("type")
    if ptype in _TEXT_PARTS:
        return None
    if ptype in _IMAGE_PARTS or (ptype is None and "image_url" in part):
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise BadRequest(f"{where}: an image part needs image_url.url", param="messages")
        return url
    raise BadRequest(f"{where}: {_unsupported(ptype)}", param="messages")


# --- bytes: data URLs, http(s) URLs and the caps -------------------------------------------------
class _Budget:
    """Bytes the request's images may still take together (``max_total_bytes``); fetches running
    at once draw on it chunk by chunk, so the cap holds while bodies stream."""

    def __init__(self, cfg: MediaConfig) -> None:
        self.limit = self.left = cfg.max_total_bytes

    def take(self, n: int, where: str) -> None:
        self.left -= n
        if self.left < 0:
            raise BadRequest(f"{where}: the request's images exceed {self.limit} bytes together "
                             "(frontend.media.max_total_bytes)", param="messages")


def _too_big(where: str, what: str, cfg: MediaConfig) -> BadRequest:
    return BadRequest(f"{where}: {what} exceeds {cfg.max_image_bytes} bytes "
                      "(frontend.media.max_image_bytes)", param="messages")


def _data_url(url: str, where: str, cfg: MediaConfig, budget: _Budget) -> str:
    """The base64 of a ``data:image/<type>;base64,<data>`` URL, its decoded size checked from its
    length (decoding takes 3 ms a MiB: it is left to the decoding thread)."""
    header, sep, payload = url[5:].partition(",")
    mime, *params = (p.strip().lower() for p in header.split(";"))
    if not sep or "base64" not in params:
        raise BadRequest(f"{where}: a data URL must be data:image/<type>;base64,<data>", param="messages")
    if not mime.startswith("image/"):
        raise BadRequest(f"{where}: the data URL's media type is {mime or 'missing'!r}, not image/*",
                         param="messages")
    if len(payload) % 4:
        raise _bad_base64(where)
    size = len(payload) // 4 * 3 - len(payload[-2:]) + len(payload[-2:].rstrip("="))
    if size > cfg.max_image_bytes:
        raise _too_big(where, "the image", cfg)
    budget.take(size, where)
    return payload


def _bad_base64(where: str) -> BadRequest:
    return BadRequest(f"{where}: the data URL's base64 is invalid", param="messages")


def _check_url(url: str, where: str, cfg: MediaConfig) -> URL:
    """The URL to request, if it is http(s) and ``allow_urls`` admits it. No DNS, no connection."""
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:
        raise BadRequest(f"{where}: the image URL is malformed", param="messages") from None
    if scheme not in ("http", "https"):
        raise BadRequest(f"{where}: image URLs must be data:, http: or https:, not {scheme or 'relative'!r}",
                         param="messages")
    if not cfg.allow_urls:
        raise BadRequest(f"{where}: image URLs are not fetched: set frontend.media.allow_urls to the hosts "
                         "or URL prefixes this server may fetch images from, or send the image as a "
                         "data: URL", param="messages")
    reason = url_refusal(url, cfg.allow_urls)
    if reason is not None:
        raise BadRequest(f"{where}: image URL {shown(url)} is refused: {reason} (frontend.media.allow_urls)",
                         param="messages")
    return URL(url)


async def _fetch(session: aiohttp.ClientSession, url: URL, where: str, cfg: MediaConfig,
                 budget: _Budget) -> bytes:
    def failed(reason: str) -> BadRequest:
        return BadRequest(f"{where}: could not fetch image URL {shown(str(url))}: {reason}", param="messages")

    try:
        async with session.get(url, allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=cfg.fetch_timeout)) as resp:
            if 300 <= resp.status < 400:
                # a redirect's target was never judged by allow_urls: the client gives the final URL
                to = resp.headers.get(aiohttp.hdrs.LOCATION, "")
                raise failed(f"HTTP {resp.status} redirect to {shown(to, 100)!r}; redirects are not "
                             "followed, give the final URL")
            if not 200 <= resp.status < 300:
                raise failed(f"HTTP {resp.status}")
            ctype = resp.headers.get(aiohttp.hdrs.CONTENT_TYPE, "").partition(";")[0].strip().lower()
            if not ctype.startswith("image/"):
                raise failed(f"its content type is {ctype or 'missing'!r}, not image/*")
            if resp.content_length is not None and resp.content_length > cfg.max_image_bytes:
                raise _too_big(where, f"the image at {shown(str(url))} (Content-Length {resp.content_length})", cfg)
            chunks, n = [], 0
            async for chunk in resp.content.iter_chunked(_CHUNK):
                n += len(chunk)
                if n > cfg.max_image_bytes:
                    raise _too_big(where, f"the image at {shown(str(url))}", cfg)
                budget.take(len(chunk), where)
                chunks.append(chunk)
            return b"".join(chunks)
    except TimeoutError:
        raise failed(f"no complete answer within {cfg.fetch_timeout:g} s (frontend.media.fetch_timeout)") from None
    except aiohttp.ClientError as e:
        raise failed(f"{type(e).__name__}: {e}") from None


# --- decoding ------------------------------------------------------------------------------------
async def _decode(src: bytes | str, where: str, cfg: MediaConfig) -> LoadedImage:
    return await asyncio.to_thread(_decode_sync, src, where, cfg)


def _decode_sync(src: bytes | str, where: str, cfg: MediaConfig) -> LoadedImage:
    """The file (``src``: its bytes, or a data URL's base64), its header checked, then decoded as
    ``vllm serve`` does (its ImageMediaIO.load_bytes). Any exception of a decoder is the file's
    fault: a 400, never a 500."""
    if isinstance(src, str):
        try:
            data = base64.b64decode(src, validate=True)
        except (binascii.Error, ValueError):
            raise _bad_base64(where) from None
    else:
        data = src
    accepted = ", ".join(cfg.formats)
    try:
        img = Image.open(io.BytesIO(data), formats=cfg.formats)  # reads the header only
        fmt = img.format or "?"
        w, h = img.size
        if w * h > cfg.max_pixels:
            raise _too_many_pixels(where, f"{w}x{h}", cfg)
        img = to_model_rgb(img)
    except BadRequest:
        raise
    except Image.DecompressionBombError:  # Pillow's own cap (2 x Image.MAX_IMAGE_PIXELS)
        raise _too_many_pixels(where, None, cfg) from None
    except Image.UnidentifiedImageError:
        raise BadRequest(f"{where}: unsupported image format (accepted: {accepted}; "
                         "frontend.media.formats)", param="messages") from None
    except Exception as e:  # truncated or corrupt data: Pillow's decoders raise many kinds
        raise BadRequest(f"{where}: the image could not be decoded: {e}", param="messages") from None
    return LoadedImage(uuid=hashlib.sha256(data).hexdigest(), data=data, width=img.width,
                       height=img.height, format=fmt, image=img)


def _too_many_pixels(where: str, size: str | None, cfg: MediaConfig) -> BadRequest:
    return BadRequest(f"{where}: the image is {size + ', ' if size else ''}over {cfg.max_pixels} pixels "
                      "(frontend.media.max_pixels)", param="messages")
