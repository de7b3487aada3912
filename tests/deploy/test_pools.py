"""Worker children from the topology: a spawn names a pool (never a command); overrides travel by
environment, not on the worker's command line."""

from __future__ import annotations

import json
import sys

import pytest

from bus.errors import BadRequest, Conflict, NotFound
from config.topology import BusConfig, PoolConfig, Topology
from config.workers import OVERRIDES_ENV, overrides_from_env
from deploy.pools import PoolSpawner, worker_spec


def _topology() -> Topology:
    return Topology(namespace="ns", bus=BusConfig(port=4333),
                    pools={"agg": PoolConfig(engine="mocker", replicas=2, status_port=65530, env={"A": "1"}),
                           "far": PoolConfig(engine="mocker", host="gpu2")})


def test_worker_command_carries_no_override() -> None:
    t = _topology()
    secret = "bus.auth.password=hunter2"
    spec, argv = worker_spec(t, "agg", 1, "/x/topo.toml", [secret])
    assert argv == [sys.executable, "-m", "actors.worker.process", "--topology", "/x/topo.toml",
                    "--pool", "agg", "--replica", "1"]
    assert "hunter2" not in " ".join(argv)
    child = spec.start()
    assert "hunter2" not in " ".join(child.argv)  # type: ignore[attr-defined]
    env = child.env  # type: ignore[attr-defined]
    assert env["A"] == "1"
    assert json.loads(env[OVERRIDES_ENV]) == [secret, "bus.url=nats://127.0.0.1:4333"]
    assert overrides_from_env(env) == [secret, "bus.url=nats://127.0.0.1:4333"]
    assert spec.id == "worker-agg-1" and spec.meta["pool"] == "agg"


def test_overrides_env_must_be_a_list_of_strings() -> None:
    assert overrides_from_env({}) == []
    with pytest.raises(ValueError):
        overrides_from_env({OVERRIDES_ENV: '{"a": 1}'})


def test_pool_spawner_names_a_pool_of_this_host() -> None:
    sp = PoolSpawner(_topology(), "/x/topo.toml", [], ["local"])
    taken = ["nats", "inproc", "worker-agg-0", "worker-agg-1"]
    assert sp.spec("agg", None, taken).id == "worker-agg-2"  # lowest free index
    assert sp.spec("agg", 0, ["worker-agg-1"]).id == "worker-agg-0"
    with pytest.raises(Conflict):
        sp.spec("agg", 1, taken)
    with pytest.raises(NotFound, match="no pool 'nope'"):
        sp.spec("nope", None, taken)
    with pytest.raises(BadRequest, match="host 'gpu2'"):
        sp.spec("far", None, taken)
    with pytest.raises(BadRequest, match="replica must be"):
        sp.spec("agg", -1, taken)
    with pytest.raises(BadRequest, match="status port"):
        sp.spec("agg", 6, [])  # 65530 + 6 > 65535


def test_workers_connect_with_worker_auth() -> None:
    from config.topology import BusAuth
    from config.workers import worker_bus

    t = _topology()
    assert worker_bus(t) is t.bus  # no worker user: the deployment's own
    t.bus.auth = BusAuth(user="supervisor", password_env="A")
    t.bus.worker_auth = BusAuth(user="worker", password_env="B")
    wb = worker_bus(t)
    assert wb.auth.user == "worker" and wb.port == t.bus.port and t.bus.auth.user == "supervisor"
