"""A cluster bus as an operator deploys it: each host's rendered nats-server config (its routes,
their credentials, TLS), ``--emit-systemd`` with one nats unit per host, and the command line that
refuses to run several cluster members in one process."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from bus.embedded import nats_server_binary
from config.loader import load_topology
from config.topology import BusAuth, BusCluster, BusConfig, BusTLS
from deploy import nats_conf
from deploy.systemd import emit_units
from tests.helpers import make_certs

ROOT = Path(__file__).resolve().parents[2]
MULTIHOST = ROOT / "topologies" / "mocker-multihost.toml"
ROUTE_ENV = "VLLM_ACTORS_ROUTE_PASSWORD"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (make test installs it: apt-get install systemd)")
SERVERS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "fd00::3"}
PASSWORD = 'p@ss:w/rd "q" %x'  # every character a URL or the config parser could take for syntax


def _cluster_block(text: str) -> list[str]:
    """The lines inside ``cluster { ... }`` (stripped)."""
    lines = text.splitlines()
    start = lines.index("cluster {")
    end = lines.index("}", start)
    return [line.strip() for line in lines[start + 1:end]]


def _item(block: list[str], key: str) -> str:
    found = [line for line in block if line.startswith(f"{key}:")]
    assert len(found) == 1, (key, block)
    return found[0].partition(":")[2].strip()


def _routes(block: list[str]) -> list[str]:
    return re.findall(r'"([^"]*)"', _item(block, "routes").replace('\\"', ""))


def _nats_check(conf: Path) -> None:
    """nats-server's own parser accepts the file (``-t``: test the config and exit)."""
    proc = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and "is valid" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_host_b_listens_on_its_address_and_routes_to_the_others_only(tmp_path: Path) -> None:
    bus = BusConfig(cluster=BusCluster(servers=SERVERS, password=PASSWORD))
    text = nats_conf.render(bus, tmp_path, host="b", namespace="ns")
    block = _cluster_block(text)
    assert _item(block, "name") == '"ns"'  # the namespace, unless the topology names the cluster
    assert _item(block, "listen") == '"10.0.0.2:6222"'
    assert "no_advertise: true" in block  # another host's 127.0.0.1 is not a client's to dial
    routes = [urlsplit(r) for r in _routes(block)]
    assert [(r.scheme, r.hostname, r.port) for r in routes] == [("nats-route", "10.0.0.1", 6222),
                                                                ("nats-route", "fd00::3", 6222)]
    assert all(r.netloc.endswith(("@10.0.0.1:6222", "@[fd00::3]:6222")) for r in routes)
    # the credentials survive the URL: the other servers see exactly the route user and password
    for r in routes:
        assert r.username is not None and r.password is not None
        assert (unquote(r.username), unquote(r.password)) == ("route", PASSWORD)
        assert " " not in r.netloc and '"' not in r.netloc
    auth = [line for line in block if line.startswith("authorization")]
    assert auth == ['authorization { user: "route", password: "p@ss:w/rd \\"q\\" %x" }']
    # quiet routes are pinged often, so a cut host's route goes in seconds, not minutes
    assert 'ping_interval: "5s"' in text.splitlines() and "ping_max: 3" in text.splitlines()
    conf = tmp_path / "b.conf"
    nats_conf.write(bus, conf, host="b", namespace="ns")
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # it holds the route password
    _nats_check(conf)


def test_each_host_renders_its_own_member() -> None:
    bus = BusConfig(cluster=BusCluster(servers=SERVERS, password="pw", name="prod", port=7244))
    for host, address in SERVERS.items():
        block = _cluster_block(nats_conf.render(bus, "/tmp", host=host, namespace="ns"))
        listen = f"[{address}]:7244" if ":" in address else f"{address}:7244"
        assert _item(block, "listen") == f'"{listen}"' and _item(block, "name") == '"prod"'
        others = sorted(h for h in SERVERS if h != host)
        assert [urlsplit(r).hostname for r in _routes(block)] == [SERVERS[h] for h in others]


def test_no_cluster_block_or_pings_without_a_cluster_or_a_host() -> None:
    plain = nats_conf.render(BusConfig(), "/tmp")
    assert plain == "max_payload: 8388608\n"
    # a cluster topology rendered for no particular host (one machine's bus): no member block
    clustered = nats_conf.render(BusConfig(cluster=BusCluster(servers=SERVERS, password="pw")), "/tmp")
    assert "cluster" not in clustered and "ping_" not in clustered


def test_insecure_routes_carry_no_credentials(tmp_path: Path) -> None:
    bus = BusConfig(cluster=BusCluster(servers=SERVERS, insecure=True))
    text = nats_conf.render(bus, tmp_path, host="a", namespace="ns")
    block = _cluster_block(text)
    assert _routes(block) == ["nats-route://10.0.0.2:6222", "nats-route://[fd00::3]:6222"]
    assert not [line for line in block if "authorization" in line]
    assert nats_conf.describe(bus).endswith("routes on port 6222 without credentials")


def test_client_auth_and_route_auth_are_separate(tmp_path: Path) -> None:
    bus = BusConfig(auth=BusAuth(token="client-tok"), cluster=BusCluster(servers=SERVERS, password="route-pw"))
    text = nats_conf.render(bus, tmp_path, host="c", namespace="ns")
    top = text.split("cluster {")[0]
    assert 'authorization { token: "client-tok" }' in top and "route-pw" not in top
    assert "client-tok" not in text.split("cluster {")[1]
    conf = tmp_path / "c.conf"
    nats_conf.write(bus, conf, host="c", namespace="ns")
    _nats_check(conf)


def test_routes_use_the_server_certificate_when_the_bus_has_tls(tmp_path: Path) -> None:
    c = make_certs(str(tmp_path))
    tls = BusTLS(ca_file=c["ca"], server_cert_file=c["server_cert"], server_key_file=c["server_key"])
    bus = BusConfig(tls=tls, cluster=BusCluster(servers=SERVERS, password="pw"))
    block = _cluster_block(nats_conf.render(bus, tmp_path, host="a", namespace="ns"))
    route_tls = [line for line in block if line.startswith("tls {")]
    assert route_tls == [f'tls {{ cert_file: "{c["server_cert"]}", key_file: "{c["server_key"]}", '
                         f'ca_file: "{c["ca"]}", verify: true }}']
    conf = tmp_path / "a.conf"
    nats_conf.write(bus, conf, host="a", namespace="ns")
    _nats_check(conf)
    # a client-only TLS section (no server certificate) does not make routes TLS
    client_only = BusConfig(tls=BusTLS(ca_file=c["ca"]), cluster=BusCluster(servers=SERVERS, password="pw"))
    assert not [line for line in _cluster_block(nats_conf.render(client_only, tmp_path, host="a"))
                if line.startswith("tls")]


def test_describe_names_the_cluster_but_never_its_password() -> None:
    words = nats_conf.describe(BusConfig(cluster=BusCluster(servers=SERVERS, password=PASSWORD)))
    assert words == ("clients: no auth, loopback only; cluster of 3 (a 10.0.0.1, b 10.0.0.2, c fd00::3), "
                     "routes on port 6222 as user route")


def _parse(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=False)
    cp.optionxform = str  # type: ignore[assignment]  # keys are case-sensitive in systemd
    cp.read(path)
    return cp


def test_emit_systemd_writes_one_nats_member_per_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ROUTE_ENV, PASSWORD)
    t = load_topology(MULTIHOST)
    paths = emit_units(t, MULTIHOST, tmp_path, python=sys.executable)
    assert sorted(p.name for p in paths) == sorted(
        [f"vllm-actors-dynamo-{h}-nats.service" for h in "abc"] + [f"vllm-actors-dynamo-{h}.service" for h in "abc"])
    out = tmp_path.resolve()
    names = set()
    for h in "abc":
        nats = _parse(tmp_path / f"vllm-actors-dynamo-{h}-nats.service")
        argv = nats["Service"]["ExecStart"].split()
        conf = out / f"vllm-actors-dynamo-{h}-nats.conf"
        assert argv[1:] == ["-c", str(conf), "-js", "-sd", f"/var/lib/vllm-actors/dynamo/nats-{h}",
                            "-a", "127.0.0.1", "-p", "4222", "-n", f"dynamo-{h}"]
        names.add(argv[-1])
        assert nats["Service"]["StateDirectory"] == f"vllm-actors/dynamo/nats-{h}"
        # routes bind the host's address: the unit waits for the network to have it
        assert nats["Unit"]["After"] == "network-online.target" and nats["Unit"]["Wants"] == "network-online.target"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        block = _cluster_block(conf.read_text())
        assert _item(block, "listen") == f'"{t.bus.cluster.servers[h]}:6222"'  # type: ignore[union-attr]
        assert len(_routes(block)) == 2 and not any(t.bus.cluster.servers[h] in r  # type: ignore[union-attr]
                                                    for r in _routes(block))
        assert PASSWORD not in nats["Service"]["ExecStart"]
        _nats_check(conf)
        host = _parse(tmp_path / f"vllm-actors-dynamo-{h}.service")
        assert host["Unit"]["Requires"] == f"vllm-actors-dynamo-{h}-nats.service"
        assert f"vllm-actors-dynamo-{h}-nats.service" in host["Unit"]["After"].split()
        assert host["Service"]["ExecStart"].endswith(
            f"-m actors.supervisor {MULTIHOST} --host {h} --set bus.url=nats://127.0.0.1:4222")
    assert names == {"dynamo-a", "dynamo-b", "dynamo-c"}


def test_an_explicit_store_dir_holds_one_store_per_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bus.store_dir is the operator's choice; each host's server keeps its store in its own
    subdirectory of it, so hosts sharing a file system never share a store."""
    monkeypatch.setenv(ROUTE_ENV, PASSWORD)
    t = load_topology(MULTIHOST, [f"bus.store_dir={tmp_path / 'js'}"])
    emit_units(t, MULTIHOST, tmp_path / "u", python=sys.executable)
    for h in "abc":
        nats = _parse(tmp_path / "u" / f"vllm-actors-dynamo-{h}-nats.service")
        assert f"-sd {tmp_path / 'js' / h} " in nats["Service"]["ExecStart"]
        assert "StateDirectory" not in nats["Service"]


@needs_systemd
def test_cluster_units_pass_systemd_analyze_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ROUTE_ENV, PASSWORD)
    paths = emit_units(load_topology(MULTIHOST), MULTIHOST, tmp_path, python=sys.executable)
    proc = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, paths)], capture_output=True, text=True,
                          timeout=60)
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 0, proc.stdout


CLI_PASSWORD = "route-secret-7f3a"


def _cli(*args: str, password: str | None = CLI_PASSWORD) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ROUTE_ENV}
    if password is not None:
        env[ROUTE_ENV] = password
    return subprocess.run([sys.executable, "-m", "actors.supervisor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=env)


def test_cli_refuses_a_cluster_topology_without_host() -> None:
    r = _cli(str(MULTIHOST))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--host" in r.stderr and "one supervisor per host" in r.stderr and "hosts: a, b, c" in r.stderr
    assert "starting" not in r.stderr  # nothing was booted


def test_cli_unknown_host_of_a_cluster_exits_2() -> None:
    r = _cli(str(MULTIHOST), "--host", "d")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --host: 'd' is not a host of this topology (hosts: a, b, c)"


def test_cli_refuses_a_cluster_whose_password_env_is_unset() -> None:
    r = _cli(str(MULTIHOST), "--check", password=None)
    assert r.returncode == 2 and f"bus.cluster.password_env: environment variable {ROUTE_ENV} is not set" in r.stderr


def test_cli_check_works_without_host_and_names_the_cluster() -> None:
    r = _cli(str(MULTIHOST), "--check")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == (f"{MULTIHOST}: namespace dynamo, bus a cluster of 3 embedded nats-servers (each host's on "
                      "127.0.0.1:4222, routes on port 6222; registry replicas 3)")
    assert [line.split(":")[0] for line in out if line.startswith("host ")] == ["host a", "host b", "host c"]
    nats_lines = [line for line in out if line.strip().startswith("- nats ")]
    assert len(nats_lines) == 3
    for h, line in zip("abc", nats_lines, strict=True):
        assert f"named dynamo-{h} " in line and f"/nats-{h}-4222)" in line
    assert CLI_PASSWORD not in r.stdout  # the route password is never printed


def test_each_member_has_its_own_store_even_under_an_explicit_store_dir(tmp_path: Path) -> None:
    """Hosts of one cluster may share a file system (the namespace tests do): one store per server."""
    from config.loader import topology_from_dict
    from config.paths import nats_store

    cluster = {"servers": {"a": "10.0.0.1", "b": "10.0.0.2"}, "insecure": True}
    bare = {"namespace": "mh", "run_dir": str(tmp_path / "run"), "frontend": {"enabled": False}}
    t = topology_from_dict({**bare, "bus": {"store_dir": str(tmp_path / "js"), "cluster": cluster}})
    assert nats_store(t, "a") == tmp_path / "js" / "a" and nats_store(t, "b") == tmp_path / "js" / "b"
    t = topology_from_dict({**bare, "bus": {"cluster": cluster}})
    assert {nats_store(t, h) for h in "ab"} == {tmp_path / "run" / "nats-a-4222", tmp_path / "run" / "nats-b-4222"}
    one = topology_from_dict({**bare, "bus": {"store_dir": str(tmp_path / "js")}})
    assert nats_store(one, "local") == tmp_path / "js"  # one server: the store as given
