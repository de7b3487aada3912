"""The nats-server configuration a deployment's own server runs with (embedded child or the
generated systemd unit), derived from the topology's ``bus`` section.

The server admits exactly what the topology says its processes connect with:

- ``bus.server_config`` set: that file is included and alone decides who may connect and what each
  user may do (per-role users, accounts, an operator and resolver for creds);
- else ``bus.auth``: one token, one user/password or one nkey, and nobody else;
- else nobody is asked for anything (loopback only: the server listens on 127.0.0.1).

``bus.tls.server_cert_file``/``server_key_file`` make the server require TLS; ``verify_clients``
makes it require client certificates signed by ``bus.tls.ca_file``.

With ``bus.cluster`` each host's server also listens for routes on its ``servers`` address and
routes to every other server (``cluster {}``): the route user and password are required of every
route (unless ``insecure``), the server's TLS certificate protects routes too, and servers do not
advertise each other's client URLs (clients listen on 127.0.0.1: another host's loopback is not
theirs to dial).

The rendered file holds secrets (a token, a password): it is written with mode 0600, and its
content is never logged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

from bus.embedded import MAX_PAYLOAD, server_config
from config.secrets import SecretError, password, read_secret_file, token
from config.topology import BusAuth, BusConfig, BusTLS

# bus.scoped_workers: the environment variable through which the root hands its embedded server the
# public key that signs its answers to the auth callout; the server_config's auth_callout block names
# it (``issuer: $VLLM_ACTORS_WORKER_ISSUER``). nats-server resolves a variable an included file
# names from the environment, not from the including file.
CALLOUT_ISSUER_ENV = "VLLM_ACTORS_WORKER_ISSUER"


def nkey_public(seed_path: str) -> str:
    """The public key (U...) of a user nkey seed file."""
    import nkeys

    seed = read_secret_file(seed_path, "bus.auth.nkey_seed")
    try:
        return nkeys.from_seed(seed.encode()).public_key.decode()
    except Exception as e:
        raise SecretError(f"bus.auth.nkey_seed: {seed_path} holds no valid nkey seed ({type(e).__name__})") from None


def _q(value: str) -> str:
    """A quoted nats-server config string (its parser reads JSON-style escapes)."""
    return json.dumps(value)


def _authorization(auth: BusAuth) -> list[str]:
    kind = auth.kind()
    if kind == "token":
        return [f"authorization {{ token: {_q(token(auth) or '')} }}"]
    if kind == "user":
        return [f"authorization {{ user: {_q(auth.user or '')}, password: {_q(password(auth) or '')} }}"]
    if kind == "nkey":
        assert auth.nkey_seed is not None
        return [f"authorization {{ users = [ {{ nkey: {_q(nkey_public(auth.nkey_seed))} }} ] }}"]
    if kind == "creds":  # the loader refuses this without server_config; keep the server closed anyway
        raise SecretError("bus.auth.creds needs bus.server_config (an operator-mode nats-server config)")
    return []


CLUSTER_PING_INTERVAL_S = 5  # seconds between the server's pings on a quiet route (or client)
CLUSTER_PING_MAX = 3  # pings unanswered before it closes the connection


def _server_tls(tls: BusTLS | None) -> list[str]:
    """The items of a ``tls {}`` block for the server's own certificate (none: no TLS)."""
    if tls is None or not (tls.server_cert_file and tls.server_key_file):
        return []
    items = [f"cert_file: {_q(os.path.abspath(tls.server_cert_file))}",
             f"key_file: {_q(os.path.abspath(tls.server_key_file))}"]
    if tls.ca_file:
        items.append(f"ca_file: {_q(os.path.abspath(tls.ca_file))}")
    return items


def _address(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address in a URL or listen spec


def _cluster(bus: BusConfig, host: str, name: str) -> list[str]:
    """The ``cluster {}`` block of ``host``'s server: listen on its address, route to the others."""
    c = bus.cluster
    assert c is not None
    secret = password(c, "bus.cluster")  # none only with insecure = true (the loader checks)
    cred = f"{quote(c.user, safe='')}:{quote(secret, safe='')}@" if secret else ""
    routes = [f"nats-route://{cred}{_address(addr)}:{c.port}" for h, addr in sorted(c.servers.items()) if h != host]
    items = [f"name: {_q(c.name or name)}", f"listen: {_q(f'{_address(c.servers[host])}:{c.port}')}",
             "no_advertise: true", f"routes: [{', '.join(_q(r) for r in routes)}]"]
    if secret:
        items.append(f"authorization {{ user: {_q(c.user)}, password: {_q(secret)} }}")
    tls = _server_tls(bus.tls)
    if tls:
        # a route is a server-to-server link: both ends present the server certificate
        items.append("tls { " + ", ".join(tls + (["verify: true"] if bus.tls and bus.tls.ca_file else [])) + " }")
    return ["cluster {", *(f"  {i}" for i in items), "}"]


def render(bus: BusConfig, conf_dir: str | Path, max_payload: int = MAX_PAYLOAD, *,
           host: str | None = None, namespace: str = "vllm-actors") -> str:
    """The config file's text; ``conf_dir`` is where it will be written (includes are relative).
    ``host``: which server of ``bus.cluster`` this is (its cluster block), if the bus is one."""
    lines = [server_config(max_payload).rstrip("\n")]  # what every embedded server runs with
    if bus.server_config:
        included = os.path.abspath(os.path.expanduser(bus.server_config))
        # nats-server resolves an include against the including file's directory, even an absolute one
        lines.append(f"include {_q(os.path.relpath(included, os.path.abspath(conf_dir)))}")
    else:
        lines += _authorization(bus.auth)
    tls = _server_tls(bus.tls)
    if tls:
        if bus.tls is not None and bus.tls.verify_clients:
            tls.append("verify: true")
        lines.append("tls { " + ", ".join(tls) + " }")
    if bus.cluster is not None and host is not None:
        # a host whose link is cut sends no FIN: the default (2 min x 2 pings) keeps its route, and
        # the subscriptions of its workers, for about 4 minutes; these drop it in 16 s (measured)
        lines += [f"ping_interval: {_q(f'{CLUSTER_PING_INTERVAL_S}s')}", f"ping_max: {CLUSTER_PING_MAX}"]
        lines += _cluster(bus, host, namespace)
    return "\n".join(lines) + "\n"


def write(bus: BusConfig, path: str | Path, max_payload: int = MAX_PAYLOAD, *,
          host: str | None = None, namespace: str = "vllm-actors") -> None:
    """Write the config with mode 0600 (it may hold a token or password)."""
    path = Path(path)
    text = render(bus, path.parent, max_payload, host=host, namespace=namespace)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an older file may have been created with a wider mode
        f.write(text)


def describe(bus: BusConfig) -> str:
    """Who the server admits, for --check and the boot log (never a secret)."""
    who = (f"users of {bus.server_config}" + (", workers as users the root issues each process (auth callout)"
                                              if bus.scoped_workers else "") if bus.server_config
           else f"{bus.auth.kind()} auth" if bus.auth.kind() else "no auth, loopback only")
    if bus.cluster is not None:
        who = f"clients: {who}"  # routes are another matter, described below
    tls = bus.tls is not None and bool(bus.tls.server_cert_file and bus.tls.server_key_file)
    who += (", TLS" + (" with client certificates" if bus.tls and bus.tls.verify_clients else "")
            if tls else "")
    c = bus.cluster
    if c is not None:
        who += (f"; cluster of {len(c.servers)} ({', '.join(f'{h} {a}' for h, a in sorted(c.servers.items()))}), "
                f"routes on port {c.port} " + (f"as user {c.user}" if (c.password, c.password_file, c.password_env) != (None, None, None)
                                              else "without credentials"))
    return who
