"""connect() authenticates by token, user/password and nkey seed against real nats-servers."""

from __future__ import annotations

import os

import nkeys
import pytest

from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port
from supervisors.topology import BusAuth, BusConfig


async def _server(tmp_path, *args: str) -> EmbeddedNats:  # type: ignore[no-untyped-def]
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"), extra_args=list(args))
    await srv.start()
    return srv


async def _check(url: str, good: BusAuth, bad: BusAuth) -> None:
    nc = await connect(BusConfig(url=url, auth=good), "auth-ok")
    await nc.flush()
    await nc.close()
    with pytest.raises(Exception):  # noqa: B017 - nats-py raises several auth error types
        nc = await connect(BusConfig(url=url, auth=bad), "auth-bad")
        await nc.close()


async def test_token_auth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = await _server(tmp_path, "--auth", "s3cret")
    try:
        await _check(srv.url, BusAuth(token="s3cret"), BusAuth(token="wrong"))
    finally:
        await srv.stop()


async def test_user_password_auth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = await _server(tmp_path, "--user", "alice", "--pass", "pw")
    try:
        await _check(srv.url, BusAuth(user="alice", password="pw"), BusAuth(user="alice", password="no"))
    finally:
        await srv.stop()


async def test_nkey_seed_auth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def seed_file(name: str) -> tuple[str, str]:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        path = tmp_path / name
        path.write_bytes(seed + b"\n")
        return str(path), nkeys.from_seed(seed).public_key.decode()

    good, pub = seed_file("good.nk")
    bad, _ = seed_file("bad.nk")
    conf = tmp_path / "auth.conf"
    conf.write_text(f'authorization {{ users = [ {{ nkey: "{pub}" }} ] }}\n')
    srv = await _server(tmp_path, "-c", str(conf))
    try:
        await _check(srv.url, BusAuth(nkey_seed=good), BusAuth(nkey_seed=bad))
    finally:
        await srv.stop()
