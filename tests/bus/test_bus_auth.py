"""The deployment's own nats-server admits exactly what the topology's ``bus`` section says, for each
auth kind (real nats-server, config rendered by ``deploy.nats_conf``): the configured
credentials connect, anonymous and wrong ones are refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest

from bus.embedded import EmbeddedNats, free_port
from config.topology import BusAuth, BusConfig, BusTLS
from deploy import nats_conf
from tests.helpers import bus_admits, make_certs, make_nkey, make_operator


async def _server(tmp_path: Path, bus: BusConfig) -> EmbeddedNats:
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"),
                       write_config=lambda path: nats_conf.write(bus, path))
    await srv.start()
    return srv


async def _check(tmp_path: Path, bus: BusConfig, wrong: list[BusAuth]) -> None:
    srv = await _server(tmp_path, bus)
    try:
        assert await bus_admits(srv.url, bus.auth, bus.tls)
        assert not await bus_admits(srv.url, BusAuth(), bus.tls), "anonymous client admitted"
        for w in wrong:
            assert not await bus_admits(srv.url, w, bus.tls), f"wrong credentials admitted: {w}"
        conf = Path(srv.store_dir or "") / "vllm-actors.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # it holds the secret
    finally:
        await srv.stop()


async def test_token_value_and_file(tmp_path: Path) -> None:
    await _check(tmp_path / "a", BusConfig(auth=BusAuth(token="s3cret")), [BusAuth(token="wrong")])
    token_file = tmp_path / "token"
    token_file.write_text("t0k-from-file\n")
    await _check(tmp_path / "b", BusConfig(auth=BusAuth(token_file=str(token_file))),
                 [BusAuth(token="wrong"), BusAuth(token="t0k-from-file\n")])


async def test_user_password_file(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text('p"w\\d\n')  # quotes and backslashes survive the config file
    await _check(tmp_path, BusConfig(auth=BusAuth(user="alice", password_file=str(pw))),
                 [BusAuth(user="alice", password="no"), BusAuth(user="bob", password='p"w\\d')])


async def test_nkey_seed(tmp_path: Path) -> None:
    make_nkey(tmp_path / "good.nk")
    make_nkey(tmp_path / "bad.nk")
    await _check(tmp_path, BusConfig(auth=BusAuth(nkey_seed=str(tmp_path / "good.nk"))),
                 [BusAuth(nkey_seed=str(tmp_path / "bad.nk")), BusAuth(token="x")])


async def test_creds_with_an_operator_mode_server_config(tmp_path: Path) -> None:
    """creds need an operator-mode server: the embedded one includes it via bus.server_config. A user
    of an unknown account and a JWT presented with another key's signature are refused."""
    op = make_operator(str(tmp_path))
    bus = BusConfig(auth=BusAuth(creds=op["creds"]), server_config=op["server_conf"])
    await _check(tmp_path, bus, [BusAuth(creds=op["stranger"]), BusAuth(creds=op["forged"])])


async def test_tls_required_and_client_certificates(tmp_path: Path) -> None:
    c = make_certs(str(tmp_path))
    tls = BusTLS(ca_file=c["ca"], server_cert_file=c["server_cert"], server_key_file=c["server_key"])
    bus = BusConfig(auth=BusAuth(token="tls-tok"), tls=tls)
    srv = await _server(tmp_path / "one", bus)
    try:
        assert await bus_admits(srv.url, bus.auth, tls)
        assert not await bus_admits(srv.url, bus.auth, None), "plain-text client admitted"
    finally:
        await srv.stop()
    # verify_clients: a TLS client without a certificate signed by the CA is refused
    strict = msgspec.structs.replace(tls, verify_clients=True)
    bus = BusConfig(auth=BusAuth(token="tls-tok"), tls=strict)
    srv = await _server(tmp_path / "two", bus)
    try:
        with_cert = msgspec.structs.replace(strict, cert_file=c["client_cert"], key_file=c["client_key"])
        assert await bus_admits(srv.url, bus.auth, with_cert)
        assert not await bus_admits(srv.url, bus.auth, tls), "client without a certificate admitted"
    finally:
        await srv.stop()


async def test_no_auth_means_an_open_loopback_server(tmp_path: Path) -> None:
    srv = await _server(tmp_path, BusConfig())
    try:
        assert srv.host == "127.0.0.1"
        assert await bus_admits(srv.url, BusAuth())
    finally:
        await srv.stop()


def test_rendered_config_never_logs_and_includes_server_config(tmp_path: Path) -> None:
    users = tmp_path / "etc" / "users.conf"
    users.parent.mkdir()
    users.write_text("authorization { users = [] }\n")
    conf_dir = tmp_path / "store"
    conf_dir.mkdir()
    text = nats_conf.render(BusConfig(auth=BusAuth(token="ignored"), server_config=str(users)), conf_dir)
    assert "ignored" not in text  # the included file alone decides who connects
    assert '"../etc/users.conf"' in text  # nats-server joins includes to the including file's dir
    assert nats_conf.describe(BusConfig(auth=BusAuth(token="sekrit"))) == "token auth"
    with pytest.raises(nats_conf.SecretError, match="empty"):
        empty = tmp_path / "empty"
        empty.write_text("\n")
        nats_conf.render(BusConfig(auth=BusAuth(token_file=str(empty))), conf_dir)
    assert os.access(users, os.R_OK)


async def test_shipped_roles_with_scoped_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """topologies/secure/roles.conf, included by the config the root renders, with the callout's
    issuer handed over as the root does (bus.scoped_workers): the role users connect, a user the
    authority issued connects through the callout, and a worker of the old shared role does not."""
    import nats

    from bus.auth_callout import WorkerAuthority
    from bus.registry import Registry
    from deploy.worker_scope import worker_scope

    roles = Path(__file__).resolve().parents[2] / "topologies" / "secure" / "roles.conf"
    pw = {r: f"{r}-pw" for r in ("supervisor", "operator", "observer")}
    for role, p in pw.items():
        monkeypatch.setenv(f"VLLM_ACTORS_{role.upper()}_PASSWORD", p)
    bus = BusConfig(auth=BusAuth(user="supervisor", password_env="VLLM_ACTORS_SUPERVISOR_PASSWORD"),
                    server_config=str(roles), scoped_workers=True)
    authority = WorkerAuthority()
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"),
                       write_config=lambda path: nats_conf.write(bus, path),
                       env={nats_conf.CALLOUT_ISSUER_ENV: authority.issuer})
    await srv.start()
    root = await nats.connect(srv.url, user="supervisor", password=pw["supervisor"])
    try:
        await authority.serve(root)
        await root.flush()
        for role in ("operator", "observer"):
            assert await bus_admits(srv.url, BusAuth(user=role, password=pw[role]))
        scope = worker_scope("dynamo", "agg", "agg-0-abc", "local", "worker-agg-0", "tiny")
        secret = authority.issue("worker-agg-0", "agg-0-abc", scope.publish, scope.subscribe)
        assert await bus_admits(srv.url, BusAuth(user="agg-0-abc", password=secret))
        assert not await bus_admits(srv.url, BusAuth(user="worker", password="anything"))
        # the first worker up (no frontend yet) creates the registry bucket and writes its own key;
        # it may not write another's, nor delete the stream
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))
        wk = await nats.connect(srv.url, user="agg-0-abc", password=secret, error_cb=on_error,
                                inbox_prefix="_INBOX.dynamo.agg-0-abc", allow_reconnect=False)
        try:
            reg = Registry(wk.jetstream(), "dynamo-instances", 10.0)
            await reg.ensure()
            await reg.put("agg-0-abc", {"instance": "agg-0-abc"})
            assert not errors, errors
            for subject in ("$KV.dynamo-instances.agg-1-def", "$JS.API.STREAM.DELETE.KV_dynamo-instances"):
                with pytest.raises(nats.errors.TimeoutError):
                    await wk.request(subject, b"", timeout=1)
            await wk.flush()
            assert [e.lower() for e in errors] == [
                'nats: permissions violation for publish to "$kv.dynamo-instances.agg-1-def"',
                'nats: permissions violation for publish to "$js.api.stream.delete.kv_dynamo-instances"']
        finally:
            await wk.close()
    finally:
        await authority.stop()
        await root.close()
        await srv.stop()
