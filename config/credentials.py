"""Semantic checks of the topology's credential and TLS settings (``bus.auth``, ``bus.worker_auth``,
``bus.server_config``, ``bus.tls``, the frontend's API key), for ``config.loader``.

Secrets are read here, at load time: a missing file or unset variable is a usage error naming the
setting (exit 2), not a start that fails later and is retried until the supervisor gives up.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from config import secrets
from config.topology import BusAuth, BusCluster, BusConfig, FrontendConfig

Fail = Callable[[str, str], Any]  # (key path, problem) -> raises TopologyError


def _readable(path: str | None, key: str, fail: Fail) -> None:
    if path is not None and not os.access(os.path.expanduser(path), os.R_OK):
        fail(key, f"cannot read {path}")


def _passwords(a: BusAuth | BusCluster, key: str, fail: Fail, named: str = "") -> list[str]:
    """Where the password comes from: at most one of value, file, environment.
    ``named``: how the message names the setting already given (a prefix of its field name)."""
    given = [n for n in ("password", "password_file", "password_env") if getattr(a, n) is not None]
    if len(given) > 1:
        fail(f"{key}.{given[1]}", f"{named}{given[0]} is already set")
    return given


def _read(fail: Fail, *read: Callable[[], object]) -> None:
    """Read the secrets now: a missing file or variable is a usage error naming the setting."""
    try:
        for r in read:
            r()
    except secrets.SecretError as e:
        setting, _, problem = str(e).partition(": ")
        fail(setting, problem)


def _check_auth(a: BusAuth, key: str, fail: Fail) -> None:
    methods = [n for n in ("token", "token_file", "token_env", "user", "nkey_seed", "creds")
               if getattr(a, n) is not None]
    if len(methods) > 1:
        fail(f"{key}.{methods[1]}", f"choose one auth method; {methods[0]} is already set")
    passwords = _passwords(a, key, fail)
    if (a.user is None) != (not passwords):
        fail(f"{key}.password" if a.user else f"{key}.user", "user and password go together")
    _read(fail, lambda: secrets.token(a, key), lambda: secrets.password(a, key))
    for field in ("nkey_seed", "creds"):
        _readable(getattr(a, field), f"{key}.{field}", fail)


def check_bus(b: BusConfig, fail: Fail) -> None:
    _check_auth(b.auth, "bus.auth", fail)
    if b.worker_auth is not None:
        _check_auth(b.worker_auth, "bus.worker_auth", fail)
    # server_config and the server's TLS files configure the embedded server; with bus.url they
    # are not read (worker processes get bus.url pointing at their host's embedded server)
    if b.server_config is not None:
        _readable(b.server_config, "bus.server_config", fail)
    elif b.url is None:
        # without a server config the embedded server admits exactly bus.auth
        if b.auth.creds is not None:
            fail("bus.auth.creds", "creds need an operator-mode server: set bus.server_config "
                 "(operator, resolver and accounts) or bus.url")
        if b.worker_auth is not None and b.worker_auth != b.auth:
            fail("bus.worker_auth", "a second user needs bus.server_config (its users and permissions) "
                 "or bus.url")
    if b.scoped_workers:
        _check_scoped_workers(b, fail)
    tls = b.tls
    if tls is not None:
        if (tls.cert_file is None) != (tls.key_file is None):
            fail("bus.tls.key_file" if tls.cert_file else "bus.tls.cert_file", "cert_file and key_file go together")
        if (tls.server_cert_file is None) != (tls.server_key_file is None):
            fail("bus.tls.server_key_file" if tls.server_cert_file else "bus.tls.server_cert_file",
                 "server_cert_file and server_key_file go together")
        if tls.verify_clients and (tls.ca_file is None or tls.server_cert_file is None):
            fail("bus.tls.verify_clients", "needs server_cert_file/server_key_file and the clients' ca_file")
        for field in ("ca_file", "cert_file", "key_file", "server_cert_file", "server_key_file"):
            _readable(getattr(tls, field), f"bus.tls.{field}", fail)


def _check_scoped_workers(b: BusConfig, fail: Fail) -> None:
    """Per-process worker users are answered by the root over the callout of its own server."""
    if b.worker_auth is not None:
        fail("bus.worker_auth", "bus.scoped_workers issues every worker its own user; drop worker_auth")
    if b.server_config is None:
        fail("bus.scoped_workers", "needs bus.server_config: users for the root (and operators) and "
             "an auth_callout block (see topologies/secure/roles.conf)")
    if b.auth.kind() not in ("user", "nkey"):
        fail("bus.auth", "bus.scoped_workers: the root answers the callout, so it must connect as "
             "a user of server_config's auth_users (user/password or nkey)")


def scoped_workers_problem(b: BusConfig, systemd: bool = False) -> str | None:
    """Why a root cannot run ``bus.scoped_workers`` with this bus, if it cannot: the callout's
    issuer is made by the root and handed to the server it embeds. Checked by the root, not by the
    loader: worker processes load the topology with bus.url set to their host's server."""
    if not b.scoped_workers:
        return None
    if systemd:
        return ("bus.scoped_workers: the systemd nats unit is not started by the root, so it cannot "
                "know the root's callout issuer; run the embedded server")
    if b.url is not None:
        return ("bus.scoped_workers: needs the embedded nats-server (no bus.url): the root hands it "
                "the callout's issuer")
    return None


def check_cluster_credentials(c: BusCluster, fail: Fail) -> None:
    """Routes listen on a routable address: a password is required unless ``insecure``."""
    if not _passwords(c, "bus.cluster", fail, named="bus.cluster.") and not c.insecure:
        fail("bus.cluster.password_file", "routes listen on a routable address: give them a password "
             "(password_file or password_env), or set bus.cluster.insecure = true on a trusted network")
    _read(fail, lambda: secrets.password(c, "bus.cluster"))


def check_api_key(fe: FrontendConfig, fail: Fail) -> None:
    given = [n for n in ("api_key", "api_key_file", "api_key_env") if getattr(fe, n) is not None]
    if len(given) > 1:
        fail(f"frontend.{given[1]}", f"choose one; frontend.{given[0]} is already set")
    _read(fail, lambda: secrets.resolve(fe.api_key, fe.api_key_file, fe.api_key_env, "frontend.api_key"))
    if fe.metrics_auth and not given:
        fail("frontend.metrics_auth", "protects /metrics with the API key: set frontend.api_key_file "
             "(or api_key_env, api_key)")
