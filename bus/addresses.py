"""The address other hosts reach this one at, for what a process advertises outside the bus (vLLM's
NIXL side channel: a decode engine on another host dials the prefill engine's address).

Found as the reference backend finds it: the host name, when it resolves to an address of this
host that is not loopback (one a socket can bind), else the source address of the route to a
peer (the kernel's choice of interface for reaching the other hosts). A UDP ``connect`` sends
nothing: it only asks the routing table.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


def split_hostport(addr: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); an empty host is every interface."""
    host, _, port = addr.rpartition(":")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def remote_hosts(urls: str | None) -> list[str]:
    """The non-loopback hosts of a comma-separated server URL list (``bus.url``)."""
    hosts = []
    for url in (urls or "").split(","):
        host = urlsplit(url.strip()).hostname
        if host and not is_loopback(host):
            hosts.append(host)
    return hosts


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
        s.bind((address, 0))
        return True
    return False


def hostname_address() -> str | None:
    """The host name's address, if it is one of this host's and not loopback."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return address if not is_loopback(address) and _bindable(address) else None


def route_source(peer: str, port: int = 9) -> str | None:
    """The local address the kernel would send from to reach ``peer`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(peer, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as s:
            s.connect(sockaddr)
            address = str(s.getsockname()[0])
            if not is_loopback(address):
                return address
    return None


def advertised_address(peers: Sequence[str]) -> str | None:
    """This host's address for the others: the host name's, else the route to the first peer that
    has one; None when neither gives a non-loopback address."""
    address = hostname_address()
    if address is not None:
        return address
    for peer in peers:
        address = route_source(peer)
        if address is not None:
            return address
    log.warning("no address of this host reaches %s; advertising none", ", ".join(peers) or "any peer")
    return None
