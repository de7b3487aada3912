"""Small helpers shared by test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import struct
import time
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI


async def eventually(cond: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``cond`` until it is true; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


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
