"""The address a host advertises to the others (NIXL's side channel): loopback is never advertised,
a remote bus's hosts are the peers to find a route to, and a cluster host advertises its own
``bus.cluster.servers`` address."""

from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path

import pytest

from actors.worker.engine_factory import advertised_host, engine_env
from bus import addresses
from bus.addresses import advertised_address, hostname_address, is_loopback, remote_hosts, route_source
from config.loader import topology_from_dict
from config.topology import Topology

TEST_NET = "198.51.100.7"  # TEST-NET-2 (RFC 5737): routed by a default route, owned by nobody


def _has_default_route() -> bool:
    try:
        rows = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(row.split()[1] == "00000000" for row in rows if len(row.split()) > 1)


def _non_loopback_ip(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return not ip.is_loopback and not ip.is_unspecified


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True),
    ("10.0.0.1", False), ("fd00::3", False), ("nats-1.internal", False), ("0.0.0.0", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_remote_hosts_keep_only_other_machines() -> None:
    urls = ("nats://127.0.0.1:4222, nats://localhost:4222,nats://10.0.0.9:4222,"
            "tls://user:pw@nats-2.internal:4443,nats://[::1]:4222,nats://[fd00::5]:4222")
    assert remote_hosts(urls) == ["10.0.0.9", "nats-2.internal", "fd00::5"]
    assert remote_hosts(None) == [] and remote_hosts("") == []
    assert remote_hosts("nats://127.0.0.1:4222") == []


def test_route_source_never_returns_loopback() -> None:
    assert route_source("127.0.0.1") is None  # the route to loopback leaves from loopback
    assert route_source("localhost") is None
    assert route_source("no-such-host.invalid") is None  # unresolvable: no route, no exception


@pytest.mark.skipif(not _has_default_route(), reason="no default route on this machine")
def test_route_source_toward_a_remote_peer_is_a_local_address() -> None:
    source = route_source(TEST_NET)
    assert source is not None and _non_loopback_ip(source)
    assert addresses._bindable(source)  # an address of this host, not the peer's or the gateway's
    assert source != TEST_NET


def _resolving_to(monkeypatch: pytest.MonkeyPatch, address: str) -> None:
    """This host's name resolves to ``address`` (what /etc/hosts or DNS would say)."""
    monkeypatch.setattr(addresses.socket, "gethostname", lambda: "this-host")
    monkeypatch.setattr(addresses.socket, "gethostbyname",
                        lambda name: address if name == "this-host" else "203.0.113.1")


def _unresolvable(name: str) -> str:
    raise socket.gaierror(socket.EAI_NONAME, f"{name}: not known")


@pytest.mark.skipif(not _has_default_route(), reason="no default route on this machine")
def test_a_host_name_naming_a_local_non_loopback_address_is_advertised(monkeypatch: pytest.MonkeyPatch) -> None:
    local = route_source(TEST_NET)  # an address of one of this host's interfaces
    assert local is not None
    _resolving_to(monkeypatch, local)
    assert hostname_address() == local
    assert advertised_address([]) == local  # no peer needed: the host name answers first


@pytest.mark.parametrize("address", ["127.0.1.1", TEST_NET])
def test_a_host_name_naming_loopback_or_another_machine_is_not_advertised(
        monkeypatch: pytest.MonkeyPatch, address: str) -> None:
    # 127.0.1.1 is Debian's /etc/hosts entry for the host name; TEST_NET is no address of this host
    _resolving_to(monkeypatch, address)
    assert hostname_address() is None
    assert advertised_address([]) is None


def test_an_unresolvable_host_name_is_not_advertised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addresses.socket, "gethostname", lambda: "this-host")
    monkeypatch.setattr(addresses.socket, "gethostbyname", _unresolvable)
    assert hostname_address() is None
    assert advertised_address([]) is None


@pytest.mark.skipif(not _has_default_route(), reason="no default route on this machine")
def test_advertised_address_falls_back_to_the_route_toward_a_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addresses, "hostname_address", lambda: None)  # a host name that names loopback
    assert advertised_address(["127.0.0.1", TEST_NET]) == route_source(TEST_NET)


def test_advertised_address_without_any_says_so(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(addresses, "hostname_address", lambda: None)
    with caplog.at_level(logging.WARNING, logger="bus.addresses"):
        assert advertised_address(["127.0.0.1", "no-such-host.invalid"]) is None
    assert "no address of this host reaches 127.0.0.1, no-such-host.invalid; advertising none" in caplog.text


def _topology(**bus: object) -> Topology:
    return topology_from_dict({
        "namespace": "t", "model": {"name": "m", "path": "tiny"}, "frontend": {"host": "a"}, "bus": bus,
        "pools": {"prefill": {"role": "prefill", "engine": "mocker", "host": "a"},
                  "decode": {"role": "decode", "engine": "mocker", "host": "b"}}})


def test_a_cluster_host_advertises_its_servers_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addresses, "hostname_address", lambda: "192.0.2.99")  # never consulted
    t = _topology(cluster={"servers": {"a": "10.0.0.1", "b": "10.0.0.2"}, "insecure": True})
    assert advertised_host(t, "a") == "10.0.0.1"
    assert advertised_host(t, "b") == "10.0.0.2"


def test_a_loopback_bus_advertises_nothing_and_a_remote_bus_what_reaches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addresses, "hostname_address", lambda: "192.0.2.99")
    assert advertised_host(_topology(), "a") is None  # one machine: vLLM's localhost
    assert advertised_host(_topology(url="nats://127.0.0.1:4222"), "a") is None
    assert advertised_host(_topology(url="nats://10.0.0.9:4222"), "a") == "192.0.2.99"


def test_the_side_channel_host_is_set_only_for_nixl_and_never_over_the_topology() -> None:
    t = topology_from_dict({
        "namespace": "t", "model": {"name": "m", "path": "tiny"},
        "pools": {
            "prefill": {"role": "prefill", "engine": "mocker", "host": "a",
                        "engine_args": {"kv_transfer_config": {"kv_connector": "NixlConnector"}}},
            "pinned": {"role": "prefill", "engine": "mocker", "host": "a",
                       "engine_args": {"kv_transfer_config": {"kv_connector": "NixlConnector"}},
                       "env": {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.9.9.9"}},
            "decode": {"role": "decode", "engine": "mocker", "host": "a"}}})
    assert engine_env(t.pools["prefill"], 0, None, "10.0.0.1")["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.1"
    assert engine_env(t.pools["pinned"], 0, None, "10.0.0.1")["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.9.9.9"
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in engine_env(t.pools["decode"], 0, None, "10.0.0.1")
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in engine_env(t.pools["prefill"], 0, None, None)
