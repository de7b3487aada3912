"""Small helpers shared by test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from bus.registry import live_entries


async def eventually(cond: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``cond`` until it is true; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def subscribed(sub: Any, probe: Callable[[int], Awaitable[object]],
                     timeout: float = 30.0) -> tuple[int, list[list[bytes]]]:
    """Wait until a ZMQ SUB socket's subscription has reached its PUB: call ``probe(n)`` (n = 1, 2,
    ...: something that makes the publisher send one message) until a message arrives. Returns how
    many probes were sent and every message received meanwhile, so a test can still account for
    the whole stream (those sent before the subscription arrived are lost, as PUB does).

    A fixed sleep is not enough: PUB drops what it sends before the subscription arrives (the
    "slow joiner"), and on a loaded machine that took longer than 0.3 s (a CI run lost every
    live frame of tests/engines/test_mocker_events.py)."""
    end = time.monotonic() + timeout
    got: list[list[bytes]] = []
    sent = 0
    while not got:
        if time.monotonic() > end:
            raise AssertionError(f"no message on the SUB socket after {timeout} s of probes")
        sent += 1
        await probe(sent)
        while await sub.poll(200):
            got.append(await sub.recv_multipart())
    return sent, got


def listening_hosts(port: int) -> set[str]:
    """Addresses with a TCP socket in LISTEN on ``port`` on this machine (/proc/net/tcp{,6}: the
    kernel's view, whatever the server claims)."""
    found: set[str] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            addr, _, hexport = cols[1].partition(":")
            if cols[3] != "0A" or int(hexport, 16) != port:  # 0A = TCP_LISTEN
                continue
            # the kernel prints each 32-bit word of the address in host byte order
            raw = b"".join(struct.pack("=I", int(addr[i:i + 8], 16)) for i in range(0, len(addr), 8))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is dead for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def openai_client(base_url: str, **kw: Any) -> AsyncOpenAI:
    """An async OpenAI client on ``base_url`` (the server root) as the tests use it: no retries (a
    test sees the first answer) and a 60 s timeout (a hang fails in a minute, not the library's 10)."""
    kw.setdefault("timeout", 60)
    kw.setdefault("api_key", "none")
    return AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", max_retries=0, **kw)


def make_certs(dirpath: Any) -> dict[str, str]:
    """A test CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM
    files in ``dirpath``: {"ca", "server_cert", "server_key", "client_cert", "client_key"}."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: Any, path: str) -> None:
        with open(path, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test-ca")).issuer_name(name("test-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out: dict[str, str] = {"ca": os.path.join(dirpath, "ca.pem")}
    with open(out["ca"], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    for who, usage in (("server", x509.ExtendedKeyUsageOID.SERVER_AUTH),
                       ("client", x509.ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(f"test-{who}")).issuer_name(ca.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if who == "server":
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        out[f"{who}_cert"] = os.path.join(dirpath, f"{who}.pem")
        out[f"{who}_key"] = os.path.join(dirpath, f"{who}-key.pem")
        with open(out[f"{who}_cert"], "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, out[f"{who}_key"])
    return out


def make_nkey(path: Any) -> str:
    """Write a fresh user nkey seed to ``path``; return its public key."""
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    with open(path, "wb") as f:
        f.write(seed + b"\n")
    os.chmod(path, 0o600)
    return nkeys.from_seed(seed).public_key.decode()


def make_operator(dirpath: Any) -> dict[str, str]:
    """A NATS operator-mode setup in ``dirpath``, as `nsc` would make one: an operator, a system
    account, an account with JetStream, and users as .creds files. Returns paths:
    {"server_conf": the nats-server config (operator, resolver MEMORY, preloaded accounts),
     "creds": a user of the account, "stranger": a user of an account the server does not know,
     "forged": the account user's JWT with another user's seed}."""
    import base64
    import hashlib
    import json

    import nkeys

    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

    def key(prefix: int) -> tuple[bytes, Any, str]:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        kp = nkeys.from_seed(seed)
        return seed, kp, kp.public_key.decode()

    def jwt(signer: Any, iss: str, sub: str, name: str, nats: dict[str, Any]) -> str:
        claims: dict[str, Any] = {"iat": int(time.time()), "iss": iss, "name": name, "sub": sub, "nats": nats}
        claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode())
                                         .digest()).decode().rstrip("=")
        head = b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
        body = b64(json.dumps(claims).encode())
        return f"{head}.{body}.{b64(signer.sign(f'{head}.{body}'.encode()))}"

    def creds(path: str, user_jwt: str, seed: bytes) -> str:
        with open(path, "w") as f:
            f.write(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                    f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")
        os.chmod(path, 0o600)
        return path

    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                 "conn": -1, "leaf": -1}
    _, op, op_pub = key(nkeys.PREFIX_BYTE_OPERATOR)
    _, _, sys_pub = key(nkeys.PREFIX_BYTE_ACCOUNT)
    _, acct, acct_pub = key(nkeys.PREFIX_BYTE_ACCOUNT)
    _, other, other_pub = key(nkeys.PREFIX_BYTE_ACCOUNT)
    op_jwt = jwt(op, op_pub, op_pub, "test-operator", {"type": "operator", "version": 2, "system_account": sys_pub})
    sys_jwt = jwt(op, op_pub, sys_pub, "SYS", {"limits": unlimited, "type": "account", "version": 2})
    js = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    acct_jwt = jwt(op, op_pub, acct_pub, "app", {"limits": {**unlimited, **js}, "type": "account", "version": 2})
    out = {"server_conf": os.path.join(dirpath, "operator.conf")}
    with open(out["server_conf"], "w") as f:
        f.write(f'operator: "{op_jwt}"\nsystem_account: {sys_pub}\nresolver: MEMORY\n'
                f'resolver_preload: {{\n  {acct_pub}: "{acct_jwt}"\n  {sys_pub}: "{sys_jwt}"\n}}\n')
    user_claims = {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}
    seed, _, pub = key(nkeys.PREFIX_BYTE_USER)
    user_jwt = jwt(acct, acct_pub, pub, "app-user", user_claims)
    out["creds"] = creds(os.path.join(dirpath, "user.creds"), user_jwt, seed)
    seed2, _, pub2 = key(nkeys.PREFIX_BYTE_USER)
    out["stranger"] = creds(os.path.join(dirpath, "stranger.creds"),
                            jwt(other, other_pub, pub2, "stranger", user_claims), seed2)
    out["forged"] = creds(os.path.join(dirpath, "forged.creds"), user_jwt, seed2)
    return out


async def bus_admits(url: str, auth: Any, tls: Any = None) -> bool:
    """Whether a nats-server at ``url`` admits a client with ``auth`` (a BusAuth) and ``tls`` (a BusTLS)."""
    from bus.connection import connect
    from config.topology import BusConfig

    try:
        nc = await connect(BusConfig(url=url, auth=auth, tls=tls), "auth-probe", initial_attempts=1)
    except Exception:  # nats-py raises several auth and TLS error types
        return False
    await nc.flush()
    await nc.close()
    return True


async def srv_ping(nc: Any, wait: float = 1.5) -> list[dict[str, Any]]:
    """Every micro service's reply to ``$SRV.PING`` within ``wait`` seconds (what ``nats micro ls``
    collects); ``nc`` is a connected nats-py client."""
    import nats.errors

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING", b"", reply=inbox)
    out = []
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            m = await sub.next_msg(timeout=0.2)
        except nats.errors.TimeoutError:
            continue
        out.append(json.loads(m.data))
    await sub.unsubscribe()
    return out


async def registry(nc: Any, ns: str) -> dict[str, dict[str, Any]]:
    """The instance records of ``<ns>-instances`` (what ``nats kv ls``/``get`` show), read the way
    the registry lists itself (``bus.registry.live_entries``: complete while heartbeats re-put)."""
    js = nc.jetstream()
    kv = await js.key_value(f"{ns}-instances")
    return {k: json.loads(v) for k, v in (await live_entries(js, kv)).items() if v}


# --- the processes a test started ---------------------------------------------------------------------
# A test that must find its own processes (and only them: other tests, or another pytest-xdist
# worker, run deployments at the same time) starts its command with this variable set to a token of
# its own; every process below it inherits the variable.
MARK = "VLLM_ACTORS_TEST_MARK"


def marked_env(mark: str) -> dict[str, str]:
    return {**os.environ, MARK: mark}


def processes_with(mark: str) -> list[str]:
    """Command lines of this user's live processes whose environment holds the marker."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if needle in env.split(b"\0"):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def assert_nothing_left(mark: str) -> None:
    end = time.monotonic() + 5.0
    while (left := processes_with(mark)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
