"""The HTTP guard (actors.frontend.http_guard) against slow and malformed clients, over real sockets.

Every test runs a real FrontendActor on the real bus; raw requests go through asyncio streams so
that nothing on the client side fixes them up. Timers are set to about a second and only bounded
from above by "timeout + generous slack", never timed closely.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
import pytest
import uvloop

from actors.frontend.http_guard import LINGER_S
from config.loader import TopologyError, topology_from_dict


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """uvloop is what the supervisor and ``python -m actors.frontend`` run (its transports are not
    asyncio's classes); plain asyncio is what the rest of the tests run."""
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


T = 0.5  # the timer under test
SLACK = 3.0  # seconds beyond a timer before a test calls a connection "not closed"
MSG = [{"role": "user", "content": "hi"}]


# --- raw HTTP helpers ---------------------------------------------------------------------------------
Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(port: int) -> Conn:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_response(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length framed: every error and JSON answer here is)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), timeout)
    return status, headers, body


async def wait_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """What the server still sends until it closes the connection; fails if it stays open."""
    data = b""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                data += chunk
    return data


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """A response read to the end of the connection."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body[:int(headers.get("content-length", len(body)))]


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int | None = None) -> None:
    if expected is not None:
        assert status == expected, body
    assert headers["content-type"].split(";")[0] == "application/json", headers
    doc = json.loads(body)
    assert list(doc) == ["error"], doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] == status


def sample(fe: Any, name: str, **labels: str) -> float:
    return fe.metrics.registry.get_sample_value(name, labels) or 0.0


async def start(deploy: Any, **cfg: Any) -> int:
    fe = await deploy.start_frontend(**cfg)
    return fe.port


# --- header timeout ---------------------------------------------------------------------------------------
async def test_silent_connection_gets_408_json_within_header_timeout(deploy: Any) -> None:
    port = await start(deploy, header_timeout=T)
    reader, writer = await connect(port)
    t0 = time.monotonic()
    raw = await wait_closed(reader, T + SLACK)
    elapsed = time.monotonic() - t0
    writer.close()
    assert elapsed >= 0.9 * T
    status, headers, body = parse(raw)
    assert_openai_error(status, headers, body, 408)
    assert headers["connection"] == "close"
    assert sample(deploy.frontend, "vllm_actors_frontend_http_timeouts_total", phase="header") == 1


async def test_slowloris_is_closed_at_header_timeout(deploy: Any) -> None:
    """A header line every 0.2 s never completes the head: the deadline counts from the opening."""
    port = await start(deploy, header_timeout=T)
    reader, writer = await connect(port)

    async def trickle() -> None:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        with contextlib.suppress(ConnectionError):
            for i in range(100):
                await asyncio.sleep(0.2)
                writer.write(b"X-Slow-%d: yes\r\n" % i)
                await writer.drain()

    task = asyncio.create_task(trickle())
    try:
        raw = await wait_closed(reader, T + SLACK)
    finally:
        task.cancel()
        writer.close()
    # the lines sent after the answer are read and dropped while it lingers: no reset, the 408 arrives
    assert_openai_error(*parse(raw), 408)
    assert sample(deploy.frontend, "vllm_actors_frontend_http_timeouts_total", phase="header") == 1


async def test_kept_alive_connection_times_its_next_head_from_first_byte(deploy: Any) -> None:
    """Idle time between requests is not header time; the next request's first byte starts the clock."""
    port = await start(deploy, header_timeout=T, keepalive_timeout=5.0)
    reader, writer = await connect(port)
    get = b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n"
    writer.write(get)
    assert (await read_response(reader))[0] == 200
    await asyncio.sleep(3 * T)  # idle past header_timeout: still open
    writer.write(get)
    assert (await read_response(reader))[0] == 200
    writer.write(b"GET /live HTTP/1.1\r\n")  # a head that never ends
    t0 = time.monotonic()
    raw = await wait_closed(reader, T + SLACK)
    writer.close()
    assert time.monotonic() - t0 >= 0.9 * T
    assert_openai_error(*parse(raw), 408)


# --- keep-alive ------------------------------------------------------------------------------------------------
async def test_idle_keepalive_connection_is_closed_silently(deploy: Any) -> None:
    """No 408 on an idle connection: a client may be sending its next request at that moment."""
    port = await start(deploy, keepalive_timeout=T)
    reader, writer = await connect(port)
    writer.write(b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    assert await wait_closed(reader, T + SLACK) == b""
    writer.close()
    assert sample(deploy.frontend, "vllm_actors_frontend_http_timeouts_total", phase="keepalive") == 1


# --- body timeout ----------------------------------------------------------------------------------------------
async def test_body_trickle_gets_408(deploy: Any) -> None:
    port = await start(deploy, body_timeout=T)
    reader, writer = await connect(port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n")

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                writer.write(b'{"model":1')
                await writer.drain()
                await asyncio.sleep(0.1)

    task = asyncio.create_task(trickle())
    try:
        status, headers, body = await read_response(reader, T + SLACK)
        assert_openai_error(status, headers, body, 408)
        assert headers["connection"] == "close"
        await wait_closed(reader, LINGER_S + SLACK)  # the unread rest of the body is not waited for
    finally:
        task.cancel()
        writer.close()
    assert sample(deploy.frontend, "vllm_actors_frontend_http_timeouts_total", phase="body") == 1


# --- connection limit -------------------------------------------------------------------------------------------
async def test_connection_limit_gives_503_and_the_freed_slot_serves(deploy: Any) -> None:
    port = await start(deploy, max_connections=2, header_timeout=30.0)
    fe = deploy.frontend
    held = [await connect(port) for _ in range(2)]  # in HEAD: not idle, so not given up
    reader, writer = await connect(port)
    raw = await wait_closed(reader, SLACK)
    writer.close()
    status, headers, body = parse(raw)
    assert_openai_error(status, headers, body, 503)
    assert headers["retry-after"] == "1" and headers["connection"] == "close"
    assert sample(fe, "vllm_actors_frontend_http_connections_refused_total") == 1

    held.pop()[1].close()
    async with asyncio.timeout(SLACK):
        while sample(fe, "vllm_actors_frontend_http_connections") > 1:
            await asyncio.sleep(0.02)
    reader, writer = await connect(port)
    writer.write(b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    writer.close()
    for _, w in held:
        w.close()


async def test_idle_connection_gives_way_at_the_limit(deploy: Any) -> None:
    port = await start(deploy, max_connections=2, keepalive_timeout=30.0)
    get = b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n"
    idle = []
    for _ in range(2):
        reader, writer = await connect(port)
        writer.write(get)
        assert (await read_response(reader))[0] == 200
        idle.append((reader, writer))
    reader, writer = await connect(port)
    writer.write(get)
    assert (await read_response(reader))[0] == 200
    assert await wait_closed(idle[0][0], SLACK) == b""  # the oldest idle one, silently
    assert sample(deploy.frontend, "vllm_actors_frontend_http_idle_evicted_total") == 1
    assert sample(deploy.frontend, "vllm_actors_frontend_http_connections_refused_total") == 0
    for _, w in [*idle, (reader, writer)]:
        w.close()


# --- handlers are never timed ----------------------------------------------------------------------------------
async def test_long_stream_is_not_cut(deploy: Any, http: aiohttp.ClientSession) -> None:
    """A stream and a slow non-streamed answer, each several times longer than every timer."""
    await deploy.worker(delay=0.25)
    await start(deploy, header_timeout=T, keepalive_timeout=T, body_timeout=T)
    await deploy.wait_ready(1)
    url = f"{deploy.url}/v1/chat/completions"

    async def streamed() -> list[bytes]:
        async with http.post(url, json={"model": "tiny", "messages": MSG, "max_tokens": 8,
                                        "stream": True}) as r:
            assert r.status == 200
            return [line async for line in r.content if line.startswith(b"data: ")]

    async def whole() -> dict[str, Any]:
        async with http.post(url, json={"model": "tiny", "messages": MSG, "max_tokens": 8}) as r:
            assert r.status == 200
            return await r.json()

    t0 = time.monotonic()
    events, doc = await asyncio.gather(streamed(), whole())
    assert time.monotonic() - t0 > 3 * T  # longer than three of any timer
    assert events[-1] == b"data: [DONE]\n"
    finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals[-1] == "length" and len(finals) >= 8
    assert doc["usage"]["completion_tokens"] == 8
    assert sample(deploy.frontend, "vllm_actors_frontend_http_timeouts_total", phase="header") == 0


# --- malformed HTTP ---------------------------------------------------------------------------------------------
H = b"Host: t\r\n"
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\n" + H + b"Content-Type: application/json\r\n"
MALFORMED: list[tuple[str, bytes]] = [
    ("garbage-request-line", b"GARBAGE\r\n\r\n"),
    ("bad-method-token", b"G(T /v1/models HTTP/1.1\r\n" + H + b"\r\n"),
    ("lowercase-method", b"get /v1/models HTTP/1.1\r\n" + H + b"\r\n"),
    ("http-9.9", b"GET /v1/models HTTP/9.9\r\n" + H + b"\r\n"),
    ("header-without-colon", b"GET /v1/models HTTP/1.1\r\nHost t\r\n\r\n"),
    ("space-before-colon", b"GET /v1/models HTTP/1.1\r\nHost : t\r\n\r\n"),
    ("obsolete-line-folding", b"GET /v1/models HTTP/1.1\r\n" + H + b"X-A: a\r\n b\r\n\r\n"),
    ("header-line-too-long", b"GET /v1/models HTTP/1.1\r\n" + H + b"X-A: " + b"a" * 9000 + b"\r\n\r\n"),
    ("request-line-too-long", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n" + H + b"\r\n"),
    ("too-many-headers", b"GET /v1/models HTTP/1.1\r\n" + H
     + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n"),
    ("bare-lf", b"GET /v1/models HTTP/1.1\n" + b"Host: t\n\n"),
    ("content-length-not-a-number", CHAT + b"Content-Length: abc\r\n\r\n"),
    ("content-length-negative", CHAT + b"Content-Length: -1\r\n\r\n"),
    ("content-length-overflow", CHAT + b"Content-Length: 99999999999999999999999\r\n\r\n"),
    ("content-length-twice", CHAT + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab"),
    ("content-length-and-chunked", CHAT + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n"),
    ("unknown-transfer-encoding", CHAT + b"Transfer-Encoding: gzip\r\n\r\nab"),
    ("chunk-size-not-hex", CHAT + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nhello\r\n0\r\n\r\n"),
    ("chunk-without-crlf", CHAT + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX\r\n0\r\n\r\n"),
    ("chunk-extension-nul", CHAT + b"Transfer-Encoding: chunked\r\n\r\n5;\x00\r\nhello\r\n0\r\n\r\n"),
    ("undecodable-gzip-body", CHAT + b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\nhello"),
    ("nul-in-path", b"GET /v1/\x00models HTTP/1.1\r\n" + H + b"\r\n"),
    ("nul-in-header-value", b"GET /v1/models HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n"),
    ("control-char-in-path", b"GET /v1/\x01 HTTP/1.1\r\n" + H + b"\r\n"),
    ("invalid-utf8-in-path", b"GET /v1/\xff\xfe HTTP/1.1\r\n" + H + b"\r\n"),
    ("bad-percent-escape", b"GET /v1/%zz HTTP/1.1\r\n" + H + b"\r\n"),
    ("absolute-form-url", b"GET http://example.com/nowhere HTTP/1.1\r\n" + H + b"\r\n"),
    ("connect", b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"),
    ("asterisk-form", b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n"),
    ("unknown-method", b"BREW /v1/models HTTP/1.1\r\n" + H + b"\r\n"),
    ("wrong-method", b"DELETE /v1/models HTTP/1.1\r\n" + H + b"\r\n"),
    ("unknown-path", b"GET /v2/models HTTP/1.1\r\n" + H + b"\r\n"),
    ("unknown-expectation", CHAT + b"Expect: 200-ok\r\nContent-Length: 2\r\n\r\n{}"),
    ("tls-client-hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32),
]


async def test_malformed_http_gets_openai_json(deploy: Any, caplog: pytest.LogCaptureFixture) -> None:
    port = await start(deploy)
    failures = []
    with caplog.at_level(logging.DEBUG):
        for name, raw in MALFORMED:
            reader, writer = await connect(port)
            writer.write(raw)
            try:
                status, headers, body = await read_response(reader)
                assert 400 <= status < 500, f"status {status}"
                assert_openai_error(status, headers, body)
                if status == 405:
                    assert "GET" in headers["allow"]
            except (AssertionError, OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
                failures.append(f"{name}: {type(e).__name__}: {e}")
            finally:
                writer.close()
    assert not failures, "\n".join(failures)
    assert sample(deploy.frontend, "vllm_actors_frontend_http_malformed_requests_total") >= 20
    # a malformed request is the client's problem: nothing above info, and no traceback
    loud = [r for r in caplog.records if r.levelno > logging.INFO or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


async def test_bad_body_after_the_handler_started_is_a_4xx(deploy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Body framing that breaks once the handler runs (head and body in separate packets).

    aiohttp's C parser raises a chunk framing error without telling the body's reader, so the
    handler learns of it only from body_timeout (408); a decoding error reaches it at once (400)."""
    port = await start(deploy, body_timeout=T)
    with caplog.at_level(logging.DEBUG):
        for name, head, rest, codes in [
                ("chunk-size-not-hex", b"Transfer-Encoding: chunked\r\n\r\n", b"ZZ\r\nhello\r\n0\r\n\r\n",
                 (400, 408)),
                ("undecodable-gzip", b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\n", b"hello", (400,))]:
            reader, writer = await connect(port)
            writer.write(CHAT + head)
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(rest)
            status, headers, body = await read_response(reader, T + SLACK)
            assert status in codes, name
            assert_openai_error(status, headers, body)
            assert headers["connection"] == "close", name
            await wait_closed(reader, LINGER_S + SLACK)
            writer.close()
    loud = [r for r in caplog.records if r.levelno > logging.INFO or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


# --- settings ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["header_timeout", "keepalive_timeout", "body_timeout", "max_connections"])
def test_guard_settings_are_checked_at_load(key: str) -> None:
    raw = {"model": {"name": "m", "path": "tiny"}, "frontend": {key: 0}}
    with pytest.raises(TopologyError, match=f"frontend.{key}"):
        topology_from_dict(raw)
