"""The ``allow_urls`` rule of a pool's LoRA settings: whether an adapter URL may be fetched.

Pure: no DNS lookup, no connection, so a URL that arrives in a NATS message is judged before anything
is sent anywhere. An entry is a host (``hub.example.com``, ``10.0.0.5:8080``, ``[::1]:8080``) or an
http(s) URL prefix; URLs with credentials, ``..`` segments (also percent-encoded), backslashes,
spaces or control characters are refused whatever the list says.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from yarl import URL

_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Refused(Exception):
    pass


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    path: str  # raw (percent-encoded, as yarl normalises it) path, "/" at least


def _norm_host(host: str | None) -> str:
    return (host or "").lower().rstrip(".")


def _has_dotdot(path: str) -> bool:
    """A ``..`` segment in ``path``, plain or percent-encoded (any depth), ``\\`` or ``;`` tricks included."""
    for _ in range(8):
        if any(seg.split(";", 1)[0] == ".." for seg in re.split(r"[/\\]", path)):
            return True
        decoded = unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True  # still decoding after 8 rounds: refuse rather than guess


def _target(url: str) -> tuple[URL, _Target]:
    """The URL as it will be requested and what the allow-list compares; raises ``_Refused``."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F or c == "\\" for c in url):
        raise _Refused("spaces, control characters and backslashes are not allowed in URLs")
    try:
        split = urlsplit(url)
    except ValueError as e:  # an unclosed IPv6 bracket
        raise _Refused(f"malformed URL ({e})") from None
    if split.scheme.lower() not in _DEFAULT_PORTS:
        raise _Refused(f"scheme {split.scheme!r} is not http or https")
    if "@" in split.netloc:
        raise _Refused("credentials in the URL (user@host) are not allowed")
    if _has_dotdot(split.path):
        raise _Refused("'..' path segments (plain or percent-encoded) are not allowed")
    try:
        parsed = URL(url)
        port = parsed.port
    except ValueError as e:
        raise _Refused(f"malformed URL ({e})") from None
    if parsed.user is not None or parsed.password is not None:
        raise _Refused("credentials in the URL (user@host) are not allowed")
    host = _norm_host(parsed.host)
    if not host or port is None:
        raise _Refused("the URL has no host")
    return parsed, _Target(parsed.scheme, host, port, parsed.raw_path or "/")


@dataclass(frozen=True)
class _Entry:
    host: str
    port: int | None  # None: the URL scheme's default port
    scheme: str | None = None  # set for a prefix entry
    prefix: str | None = None  # prefix entry's path without its trailing "/" ("" = every path)


@functools.lru_cache(maxsize=256)  # the same few entries are checked for every fetched URL
def parse_allow_entry(entry: str) -> _Entry | None:
    """One ``allow_urls`` entry, or None when it is malformed (a malformed entry admits nothing)."""
    entry = entry.strip()
    if not entry or "*" in entry:
        return None
    if "://" in entry:
        try:
            parsed, t = _target(entry)
        except _Refused:
            return None
        if parsed.raw_query_string or parsed.raw_fragment:
            return None
        return _Entry(t.host, t.port, t.scheme, t.path.rstrip("/"))
    if any(c in entry for c in "/?#@\\") or any(c.isspace() for c in entry):
        return None
    try:
        parsed = URL("http://" + entry)
        port = parsed.explicit_port
    except ValueError:
        return None
    host = _norm_host(parsed.host)
    return _Entry(host, port) if host else None


def _admits(entry: _Entry, t: _Target) -> bool:
    if entry.host != t.host:
        return False
    if entry.prefix is None:  # host entry: any http(s) path on that host and port
        return t.port == (entry.port if entry.port is not None else _DEFAULT_PORTS[t.scheme])
    if entry.scheme != t.scheme or entry.port != t.port:
        return False
    return entry.prefix == "" or t.path == entry.prefix or t.path.startswith(entry.prefix + "/")


def url_refusal(url: str, allow_urls: Sequence[str]) -> str | None:
    """Why ``url`` may not be fetched under ``allow_urls``, or None when it may. No DNS, no I/O.

    An entry is a host (``hub.example.com``, ``10.0.0.5:8080``, ``[::1]:8080``): the URL's host equal
    (case-insensitive, trailing dot ignored) and its port equal to the entry's, or to the scheme's
    default port when the entry names none; or a URL prefix (``https://hub.example.com/loras/``):
    scheme, host and port equal and the path equal to the prefix's or below it on a "/" boundary.
    URLs with credentials, ``..`` segments (also percent-encoded), backslashes or spaces are refused.
    """
    if not allow_urls:
        return "http(s) adapters are disabled"
    try:
        _, target = _target(url)
    except _Refused as e:
        return str(e)
    for raw in allow_urls:
        entry = parse_allow_entry(raw)
        if entry is not None and _admits(entry, target):
            return None
    return "no allow_urls entry admits its host, port and path"


def url_allowed(url: str, allow_urls: Sequence[str]) -> bool:
    return url_refusal(url, allow_urls) is None


def shown(url: str, limit: int = 300) -> str:
    """``url`` for messages: credentials masked, length capped."""
    try:
        split = urlsplit(url)
    except ValueError:  # unparsable: credentials in it could not be found to mask
        return "<malformed URL>"
    if "@" in split.netloc:
        url = url.replace(split.netloc, "***@" + split.netloc.rsplit("@", 1)[1], 1)
    return url if len(url) <= limit else url[:limit] + "..."
