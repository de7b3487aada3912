"""``bus.cluster`` and ``bus.kv_replicas``: what the loader refuses (with the key an operator must fix),
which hosts a cluster topology has, and the registry replicas and server names it resolves to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from config.loader import TopologyError, load_topology, topology_from_dict
from config.workers import kv_replicas, server_name

ROOT = Path(__file__).resolve().parents[2]
MULTIHOST = ROOT / "topologies" / "mocker-multihost.toml"
ROUTE_ENV = "VLLM_ACTORS_ROUTE_PASSWORD"


def _raw(**cluster: Any) -> dict[str, Any]:
    """A three-host mocker deployment (frontend and prefill on a, decode on b) with a cluster bus."""
    return {
        "namespace": "t",
        "model": {"name": "m", "path": "tiny"},
        "frontend": {"host": "a"},
        "bus": {"port": 4222, "cluster": {"servers": {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"},
                                          "insecure": True, **cluster}},
        "pools": {"prefill": {"role": "prefill", "engine": "mocker", "host": "a"},
                  "decode": {"role": "decode", "engine": "mocker", "host": "b"}},
    }


def _error(raw: dict[str, Any], *overrides: str) -> TopologyError:
    with pytest.raises(TopologyError) as info:
        topology_from_dict(raw, "topo.toml", overrides)
    return info.value


def test_a_valid_cluster_loads() -> None:
    t = topology_from_dict(_raw())
    assert t.bus.cluster is not None and t.bus.cluster.servers["b"] == "10.0.0.2"
    assert t.bus.cluster.port == 6222 and t.bus.url is None


def test_a_cluster_without_servers_is_refused() -> None:
    e = _error(_raw(servers={}))
    assert e.key == "bus.cluster.servers" and "name each host's server" in e.problem


@pytest.mark.parametrize("address", ["10.0.0.2:6222", "nats://10.0.0.2", "b.internal:4222", "", "10.0.0.2 x",
                                     "route@10.0.0.2", "[fd00::2]"])
def test_a_server_address_with_a_port_or_scheme_is_refused(address: str) -> None:
    e = _error(_raw(), f'bus.cluster.servers={{ a = "10.0.0.1", b = "{address}", c = "10.0.0.3" }}')
    assert e.key == "bus.cluster.servers.b"
    assert "no port, no scheme" in e.problem and repr(address) in e.problem


@pytest.mark.parametrize("address", ["b.internal", "fd00::2", "10.0.0.2"])
def test_plain_addresses_and_ipv6_are_accepted(address: str) -> None:
    t = topology_from_dict(_raw(), overrides=[f'bus.cluster.servers={{ a = "10.0.0.1", b = "{address}", '
                                              'c = "10.0.0.3" }'])
    assert t.bus.cluster is not None and t.bus.cluster.servers["b"] == address


def test_a_host_of_the_topology_without_a_server_is_refused() -> None:
    """decode runs on b: with servers only on a and c, b's processes would have no bus to connect to."""
    e = _error(_raw(), 'bus.cluster.servers={ a = "10.0.0.1", c = "10.0.0.3" }')
    assert e.key == "bus.cluster.servers" and "host(s) b of this topology run no server" in e.problem


def test_a_host_without_a_server_is_fine_when_the_bus_is_external() -> None:
    """With bus.url every process connects to that URL: no host needs a server of its own."""
    t = topology_from_dict(_raw(), overrides=['bus.cluster.servers={ a = "10.0.0.1" }',
                                              "bus.url=nats://10.0.0.9:4222"])
    assert t.bus.url == "nats://10.0.0.9:4222"


def test_the_route_port_must_differ_from_the_client_port() -> None:
    e = _error(_raw(), "bus.cluster.port=4222")
    assert e.key == "bus.cluster.port" and e.problem == "the route port must differ from bus.port (4222) (set by --set)"
    assert _error(_raw(port=70000)).key == "bus.cluster.port"


def test_routes_need_a_password_unless_insecure() -> None:
    e = _error(_raw(insecure=False))
    assert e.key == "bus.cluster.password_file"
    assert "give them a password" in e.problem and "insecure = true" in e.problem
    t = topology_from_dict(_raw(insecure=False, password="s3cret"))
    assert t.bus.cluster is not None and t.bus.cluster.password == "s3cret"


def test_two_password_sources_are_refused() -> None:
    e = _error(_raw(password="x", password_env=ROUTE_ENV))
    assert e.key == "bus.cluster.password_env" and e.problem == "bus.cluster.password is already set"


def test_an_unset_password_env_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROUTE_ENV, raising=False)
    e = _error(_raw(insecure=False, password_env=ROUTE_ENV))
    assert e.key == "bus.cluster.password_env" and ROUTE_ENV in e.problem and "not set" in e.problem
    monkeypatch.setenv(ROUTE_ENV, "from-env")
    topology_from_dict(_raw(insecure=False, password_env=ROUTE_ENV))


def test_a_missing_password_file_is_refused_at_load(tmp_path: Path) -> None:
    e = _error(_raw(insecure=False, password_file=str(tmp_path / "absent")))
    assert e.key == "bus.cluster.password_file"


@pytest.mark.parametrize("replicas", [0, 6, -1])
def test_kv_replicas_outside_jetstreams_range_is_refused(replicas: int) -> None:
    e = _error(_raw(), f"bus.kv_replicas={replicas}")
    assert e.key == "bus.kv_replicas" and f"expected 1..5 (JetStream's limit), got {replicas}" in e.problem


def test_kv_replicas_above_the_server_count_is_refused() -> None:
    e = _error(_raw(), "bus.kv_replicas=4")
    assert e.key == "bus.kv_replicas" and "4 replicas need as many servers; the cluster has 3" in e.problem
    # without a cluster the loader cannot count an external cluster's servers: 1..5 is all it checks
    raw = _raw()
    del raw["bus"]["cluster"]
    t = topology_from_dict(raw, overrides=["bus.url=nats://10.0.0.9:4222", "bus.kv_replicas=5"])
    assert kv_replicas(t) == 5


def test_hosts_include_a_bus_only_server() -> None:
    """c runs no pool and no frontend: it is still a host (its supervisor runs its server)."""
    t = topology_from_dict(_raw())
    assert t.hosts() == ["a", "b", "c"]
    raw = _raw()
    del raw["bus"]["cluster"]
    assert topology_from_dict(raw).hosts() == ["a", "b"]


def test_kv_replicas_defaults_follow_the_server_count() -> None:
    raw = _raw()
    del raw["bus"]["cluster"]
    assert kv_replicas(topology_from_dict(raw)) == 1  # no cluster
    two = topology_from_dict(_raw(servers={"a": "10.0.0.1", "b": "10.0.0.2"}))
    assert kv_replicas(two) == 1  # R2 would stop with either server
    assert kv_replicas(topology_from_dict(_raw())) == 3
    four = topology_from_dict(_raw(servers={h: f"10.0.0.{i}" for i, h in enumerate("abcd", 1)}))
    assert kv_replicas(four) == 3
    assert kv_replicas(topology_from_dict(_raw(), overrides=["bus.kv_replicas=2"])) == 2  # explicit wins
    assert kv_replicas(topology_from_dict(two_raw := _raw(servers={"a": "10.0.0.1", "b": "10.0.0.2"}),
                                          overrides=["bus.kv_replicas=2"])) == 2
    assert two_raw["bus"].get("kv_replicas") is None  # overrides never touch the caller's dict


def test_server_names_are_stable_per_host() -> None:
    t = topology_from_dict(_raw())
    assert [server_name(t, h) for h in t.hosts()] == ["t-a", "t-b", "t-c"]
    assert server_name(t, "b") == server_name(topology_from_dict(_raw()), "b")


def test_the_shipped_multihost_topology_with_set_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ROUTE_ENV, "pw")
    t = load_topology(MULTIHOST)
    assert t.hosts() == ["a", "b", "c"] and kv_replicas(t) == 3
    with pytest.raises(TopologyError) as info:
        load_topology(MULTIHOST, ['bus.cluster.servers={ a = "10.0.0.1" }'])
    assert str(info.value) == (f"{MULTIHOST}: bus.cluster.servers: host(s) b, c of this topology run no server: "
                               "add them (every host connects to its own server on 127.0.0.1) (set by --set)")
    monkeypatch.delenv(ROUTE_ENV)
    with pytest.raises(TopologyError, match=f"bus.cluster.password_env: .*{ROUTE_ENV}"):
        load_topology(MULTIHOST)
