"""Per-process bus users through nats-server's auth callout (bus.auth_callout), against a real
nats-server whose config names the callout as topologies/secure/roles.conf does: an issued user
connects and may use exactly its grant (anything else is a permissions violation the client is
told of), a wrong or revoked secret is refused, a user no root issued is refused, and garbage on the
callout subject leaves the responder answering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.auth_callout import CalloutError, WorkerAuthority, decode_request, encode_jwt
from bus.embedded import EmbeddedNats, free_port
from bus.subjects import AUTH_CALLOUT
from deploy.nats_conf import CALLOUT_ISSUER_ENV

CONF = f"""
authorization {{
  users = [ {{ user: root, password: rootpw, permissions: {{ publish: ">", subscribe: ">" }} }} ]
  auth_callout {{ issuer: ${CALLOUT_ISSUER_ENV}, auth_users: [ root ] }}
}}
"""


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedNats, WorkerAuthority]]:
    authority = WorkerAuthority()
    def write(path: str) -> None:  # as deploy.nats_conf does: an include beside the config
        Path(path).with_name("roles.conf").write_text(CONF)
        Path(path).write_text('include "roles.conf"\n')

    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"), write_config=write,
                       env={CALLOUT_ISSUER_ENV: authority.issuer})
    await srv.start()
    root = await nats.connect(srv.url, user="root", password="rootpw")
    await authority.serve(root)
    await root.flush()
    try:
        yield srv, authority
    finally:
        await authority.stop()
        await root.close()
        await srv.stop()


async def _connect(url: str, user: str, password: str, errors: list[str] | None = None) -> Any:
    async def on_error(e: Exception) -> None:
        if errors is not None:
            errors.append(str(e))
    return await nats.connect(url, user=user, password=password, error_cb=on_error, allow_reconnect=False,
                              max_reconnect_attempts=1, connect_timeout=5)


async def _violations(nc: Any, errors: list[str]) -> list[str]:
    await nc.flush()
    await asyncio.sleep(0.2)  # the server's -ERR follows the PONG that ended the flush
    return [e for e in errors if "permissions violation" in e]


async def test_an_issued_user_gets_exactly_its_grant(served: tuple[EmbeddedNats, WorkerAuthority]) -> None:
    srv, authority = served
    secret = authority.issue("worker-a-0", "a-0-abc", publish=["ns.worker.a-0-abc.>", "_INBOX.ns.>"],
                             subscribe=["ns.worker.a-0-abc.>", "_INBOX.ns.a-0-abc.>", "ns.a.generate q"])
    errors: list[str] = []
    nc = await _connect(srv.url, "a-0-abc", secret, errors)
    try:
        got = await nc.subscribe("ns.worker.a-0-abc.health")
        await nc.subscribe("ns.a.generate", queue="q")
        await nc.publish("ns.worker.a-0-abc.health", b"own")
        assert (await got.next_msg(timeout=5)).data == b"own"
        assert not await _violations(nc, errors)
        await nc.publish("ns.worker.b-0-def.sleep", b"{}")
        await nc.subscribe("ns.a.generate")  # the pool's requests without the queue group: all of them
        await nc.subscribe("_INBOX.ns.>")
        seen = await _violations(nc, errors)
        assert seen == ['nats: permissions violation for publish to "ns.worker.b-0-def.sleep"',
                        'nats: permissions violation for subscription to "ns.a.generate"',
                        'nats: permissions violation for subscription to "_inbox.ns.>"'], seen
    finally:
        await nc.close()


async def test_wrong_revoked_and_unknown_credentials_are_refused(served: tuple[EmbeddedNats, WorkerAuthority]) -> None:
    srv, authority = served
    first = authority.issue("worker-a-0", "a-0-abc", ["x"], ["x"])
    with pytest.raises(Exception, match="[Aa]uthorization"):
        await _connect(srv.url, "a-0-abc", "not-the-secret")
    # the child restarted: a new user and secret; the first incarnation's are no longer honoured
    second = authority.issue("worker-a-0", "a-0-def", ["x"], ["x"])
    with pytest.raises(Exception):  # noqa: B017  # unknown now: the server's auth timeout refuses it
        await _connect(srv.url, "a-0-abc", first)
    nc = await _connect(srv.url, "a-0-def", second)
    await nc.close()
    with pytest.raises(Exception):  # noqa: B017
        await _connect(srv.url, "root-of-nothing", "x")


async def test_garbage_on_the_callout_subject_is_ignored(served: tuple[EmbeddedNats, WorkerAuthority]) -> None:
    srv, authority = served
    root = await nats.connect(srv.url, user="root", password="rootpw")
    try:
        for junk in (b"", b"not a jwt", b"a.b.c", b"x." + b"e30" + b".y"):
            await root.publish(AUTH_CALLOUT, junk)
        await root.flush()
    finally:
        await root.close()
    secret = authority.issue("worker-a-0", "a-0-abc", ["x"], ["x"])
    nc = await _connect(srv.url, "a-0-abc", secret)
    await nc.close()


def test_decode_request_names_what_is_wrong() -> None:
    with pytest.raises(CalloutError, match="malformed"):
        decode_request(b"junk")
    not_a_request = encode_jwt(WorkerAuthority()._issuer, {"aud": "someone", "nats": {"type": "user"}})
    with pytest.raises(CalloutError, match="not an authorization request"):
        decode_request(not_a_request.encode())
