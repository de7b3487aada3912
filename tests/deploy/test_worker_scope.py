"""bus.scoped_workers without a server: what a worker's user may do (deploy.worker_scope), the
hand-off of a new user at every start of a worker child (deploy.pools), what a worker process
connects with (config.workers), and the settings the loader and the root refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.auth_callout import AuthRequest, WorkerAuthority
from config.credentials import scoped_workers_problem
from config.loader import TopologyError, load_topology
from config.topology import BusAuth, BusConfig, ModelConfig, PoolConfig, Topology
from config.workers import BUS_PASSWORD_ENV, BUS_USER_ENV, INSTANCE_ENV, given_instance, worker_bus
from deploy import nats_conf
from deploy.pools import PoolSpawner, worker_spec
from deploy.worker_scope import HEALTH_KIND, KV_PUBLISHER_KIND, LORA_KIND, QUEUE, worker_scope

ROOT = Path(__file__).resolve().parents[2]


def test_a_worker_may_use_its_own_subjects_only() -> None:
    s = worker_scope("ns", "agg", "agg-0-abc", "local", "worker-agg-0", "tiny")
    pub, sub = set(s.publish), set(s.subscribe)
    # its own verbs, probe, KV events, load, registry keys, and replies to any caller
    assert {"ns.worker.agg-0-abc.>", "ns.agg.generate.agg-0-abc", "ns.kv.events.agg-0-abc", "ns.load.agg-0-abc",
            "$KV.ns-instances.agg-0-abc", "$KV.ns-models.tiny.agg", "$KV.ns-loras.agg-0-abc.>",
            "_INBOX.>", "ns.supervisor.local.worker-agg-0.>"} <= pub
    # its pool's requests only as a member of the queue group; its own inbox, never the deployment's
    assert {"ns.agg.generate q", "ns.agg.generate.agg-0-abc", "_INBOX.ns.agg-0-abc.>",
            "ns.kv.index.agg-0-abc.>", "ns.health.health-agg-0-abc.cancel"} <= sub
    assert "ns.agg.generate" not in sub and not {"_INBOX.ns.>", "_INBOX.>"} & sub
    # nothing wider than its own: no other worker, supervisor or stream administration
    for p in pub | sub:
        assert not p.startswith(("ns.worker.*", "ns.supervisor.local.>", "ns.>", ">", "$JS.API.>",
                                 "$JS.API.STREAM.DELETE", "$JS.API.STREAM.PURGE")), p
        assert "agg-0-abc" in p or p.startswith(("$JS.API.STREAM.INFO.", "$JS.API.", "$SRV.", "_INBOX.>",
                                                   "ns.supervisor.local.worker-agg-0", "$KV.ns-models.tiny.agg",
                                                   "ns.agg.generate q")), p


def test_the_scope_names_the_actors_a_worker_runs() -> None:
    from actors.worker.health import HealthMonitor
    from actors.worker.kv_publisher import KvPublisherActor
    from actors.worker.lora_actor import LoraActor
    from bus.micro import EndpointSpec

    assert (HealthMonitor.kind, KvPublisherActor.kind, LoraActor.kind) == (HEALTH_KIND, KV_PUBLISHER_KIND, LORA_KIND)
    assert EndpointSpec.__dataclass_fields__["queue_group"].default == QUEUE


def _topology() -> Topology:
    return Topology(namespace="ns", bus=BusConfig(port=4333, scoped_workers=True),
                    model=ModelConfig(name="tiny", path="tiny"),
                    pools={"agg": PoolConfig(engine="mocker", replicas=2)})


def test_every_start_hands_over_a_new_user_and_revokes_the_last() -> None:
    t = _topology()
    authority = WorkerAuthority()
    spec, _ = worker_spec(t, "agg", 1, "/x/topo.toml", [], authority)
    first = spec.start().env  # type: ignore[attr-defined]
    second = spec.start().env  # type: ignore[attr-defined]  # the root restarts the child
    assert first[INSTANCE_ENV].startswith("agg-1-") and first[BUS_USER_ENV] == first[INSTANCE_ENV]
    assert second[INSTANCE_ENV] != first[INSTANCE_ENV] and second[BUS_PASSWORD_ENV] != first[BUS_PASSWORD_ENV]

    def ask(env: dict[str, str]) -> str | None:
        return authority.answer(AuthRequest(user_nkey="U" + "A" * 55, server_id="N" + "A" * 55,
                                            user=env[BUS_USER_ENV], password=env[BUS_PASSWORD_ENV]))
    assert ask(first) is None  # the first incarnation's user is no longer ours
    assert ask(second) is not None
    # a spawn through the root's control service hands over a user from the same authority
    spawned = PoolSpawner(t, "/x/topo.toml", [], ["local"], authority).spec("agg", None, ["worker-agg-0", "worker-agg-1"])
    env = spawned.start().env  # type: ignore[attr-defined]
    assert env[INSTANCE_ENV].startswith("agg-2-") and ask(env) is not None
    # without scoped workers, no credentials travel
    plain, _ = worker_spec(Topology(namespace="ns", pools={"agg": PoolConfig(engine="mocker")}), "agg", 0,
                           "/x/topo.toml", [])
    assert BUS_USER_ENV not in plain.start().env  # type: ignore[attr-defined]


def test_a_worker_connects_with_what_it_was_handed() -> None:
    t = _topology()
    t.bus.auth = BusAuth(user="supervisor", password="s")
    handed = {BUS_USER_ENV: "agg-0-abc", BUS_PASSWORD_ENV: "secret", INSTANCE_ENV: "agg-0-abc"}
    assert worker_bus(t, handed).auth == BusAuth(user="agg-0-abc", password_env=BUS_PASSWORD_ENV)
    assert worker_bus(t, {}).auth.user == "supervisor"  # started by hand: the topology's own user
    assert given_instance("agg", 0, handed) == "agg-0-abc"
    assert given_instance("agg", 0, {}).startswith("agg-0-")
    with pytest.raises(ValueError, match=INSTANCE_ENV):
        given_instance("agg", 0, {INSTANCE_ENV: "agg.0.>"})


def test_settings_scoped_workers_needs(tmp_path: Path) -> None:
    roles = ROOT / "topologies" / "secure" / "roles.conf"
    base = [f"bus.server_config={roles}", "bus.auth.user=supervisor", "bus.auth.password=x",
            "bus.scoped_workers=true"]
    topo = ROOT / "topologies" / "mocker-agg.toml"
    t = load_topology(topo, base)
    assert t.bus.scoped_workers and scoped_workers_problem(t.bus) is None
    assert "auth callout" in nats_conf.describe(t.bus)
    with pytest.raises(TopologyError, match="drop worker_auth"):
        load_topology(topo, [*base, "bus.worker_auth.user=w", "bus.worker_auth.password=y"])
    with pytest.raises(TopologyError, match="needs bus.server_config"):
        load_topology(topo, ["bus.auth.user=supervisor", "bus.auth.password=x", "bus.scoped_workers=true"])
    with pytest.raises(TopologyError, match="auth_users"):
        load_topology(topo, [f"bus.server_config={roles}", "bus.scoped_workers=true"])
    # the root refuses a server it does not start: it could not hand it the callout's issuer
    url = load_topology(topo, [*base, "bus.url=nats://127.0.0.1:4222"])
    assert "embedded" in (scoped_workers_problem(url.bus) or "")
    assert "systemd" in (scoped_workers_problem(t.bus, systemd=True) or "")


def test_the_profiler_runs_a_scoped_pool_on_its_private_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler's private nats-server has no callout and no root to answer one: its worker joins
    unscoped, and the topology with the profiler's overrides still loads."""
    from types import SimpleNamespace

    from actors.planner.profile import private_overrides

    monkeypatch.chdir(ROOT)
    for name in ("VLLM_ACTORS_SUPERVISOR_PASSWORD", "VLLM_ACTORS_API_KEY"):
        monkeypatch.setenv(name, "x")
    secure = ROOT / "topologies" / "mocker-secure.toml"
    t = load_topology(secure)
    world = SimpleNamespace(namespace="prof", run_dir="/tmp/prof", url="nats://127.0.0.1:4999", port=4999)
    sets = private_overrides(t, "agg", world)  # type: ignore[arg-type]
    assert "bus.scoped_workers=false" in sets
    assert not load_topology(secure, sets).bus.scoped_workers
