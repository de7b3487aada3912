"""Topology loading: overrides, msgspec error translation and semantic checks.

Every broken fixture under tests/fixtures/topologies carries its exact expected error on its first
line (``# expect: <key.path>: <problem>``); the loader must produce ``<file>: `` + that text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from config.loader import (
    TopologyError,
    load_topology,
    parse_override,
    topology_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "topologies"
BAD = sorted(FIXTURES.glob("bad_*.toml"))
MODEL = {"name": "m", "path": "tiny"}


def test_there_are_at_least_ten_broken_fixtures() -> None:
    assert len(BAD) >= 10


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_broken_fixture_gives_precise_error(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} lacks its '# expect:' line"
    expected = first.removeprefix("# expect: ")
    rel = path.relative_to(ROOT)
    with pytest.raises(TopologyError) as info:
        load_topology(rel)
    assert str(info.value) == f"{rel}: {expected}"


def test_shipped_topologies_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # shipped paths are relative to the checkout
    secure = ROOT / "topologies" / "mocker-secure.toml"
    # secrets named by environment must be there at load time, not fail a start later
    for name in ("VLLM_ACTORS_SUPERVISOR_PASSWORD", "VLLM_ACTORS_WORKER_PASSWORD", "VLLM_ACTORS_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TopologyError, match="bus.auth.password_env: environment variable "
                                            "VLLM_ACTORS_SUPERVISOR_PASSWORD is not set"):
        load_topology(secure)
    for name in ("VLLM_ACTORS_SUPERVISOR_PASSWORD", "VLLM_ACTORS_WORKER_PASSWORD", "VLLM_ACTORS_API_KEY",
                 "VLLM_ACTORS_ROUTE_PASSWORD"):
        monkeypatch.setenv(name, "x")
    for path in sorted((ROOT / "topologies").glob("*.toml")):
        load_topology(path)


def test_echo_topology() -> None:
    t = load_topology(ROOT / "topologies" / "echo.toml")
    assert t.echo and t.namespace == "echo" and t.bus.url is None
    assert t.hosts() == ["local"]


def test_missing_file() -> None:
    with pytest.raises(TopologyError, match=r"^nope\.toml: cannot read topology: No such file"):
        load_topology("nope.toml")


@pytest.mark.parametrize(("text", "value"), [
    ("4223", 4223), ("1.5", 1.5), ("true", True), ('"quoted"', "quoted"),
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"), ("node-1", "node-1"),
    ("[1, 2]", [1, 2]), ("{ a = 1 }", {"a": 1}), ("", ""),
])
def test_override_values_parse_as_toml_literals_else_strings(text: str, value: object) -> None:
    assert parse_override(f"a.b={text}") == (["a", "b"], value)


def test_overrides_create_intermediate_tables_and_reach_dict_keys() -> None:
    t = topology_from_dict({"model": MODEL}, "t.toml", [
        "pools.decode.role=decode", "pools.decode.replicas=3", "pools.decode.engine=mocker",
        "pools.decode.engine_args.speedup_ratio=10.0", "pools.decode.env.OMP_NUM_THREADS=1",
        "bus.url=nats://127.0.0.1:4333", "frontend.enabled=false",
    ])
    pool = t.pools["decode"]
    assert (pool.role, pool.replicas, pool.engine) == ("decode", 3, "mocker")
    assert pool.engine_args == {"speedup_ratio": 10.0}
    assert pool.env == {"OMP_NUM_THREADS": "1"}
    assert t.bus.url == "nats://127.0.0.1:4333"


def test_override_replaces_file_value(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text('namespace = "a"\n[frontend]\nenabled = false\n[bus]\nport = 4222\n')
    assert load_topology(p, ["bus.port=5000"]).bus.port == 5000


def test_override_error_mentions_set() -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict({"model": MODEL}, "t.toml", ["pools.w.replicas=0"])
    assert str(info.value) == "t.toml: pools.w.replicas: expected int >= 1, got 0 (set by --set)"


@pytest.mark.parametrize(("item", "message"), [
    ("noequals", "t.toml: --set 'noequals': expected key.path=value"),
    ("a..b=1", "t.toml: --set 'a..b=1': empty segment in key path 'a..b'"),
    ("namespace.x=1", "t.toml: namespace: --set 'namespace.x=1': namespace is a string, not a table"),
])
def test_bad_override_syntax(item: str, message: str) -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict({"namespace": "n", "frontend": {"enabled": False}}, "t.toml", [item])
    assert str(info.value) == message


def test_unknown_override_key_is_rejected() -> None:
    with pytest.raises(TopologyError, match=r"^t\.toml: bus\.prot: unknown key \(allowed: url, port"):
        topology_from_dict({"frontend": {"enabled": False}}, "t.toml", ["bus.prot=1"])


def test_dict_key_is_located_among_many() -> None:
    """msgspec says pools[...]; the loader must name the one pool that is wrong."""
    pools = {f"p{i}": {"replicas": 1} for i in range(6)}
    pools["p4"]["replicas"] = "two"
    with pytest.raises(TopologyError) as info:
        topology_from_dict({"model": MODEL, "pools": pools}, "t.toml")
    assert str(info.value) == "t.toml: pools.p4.replicas: expected int, got str ('two')"


def test_mocker_engine_args_are_free_form_and_agg_disagg_mix_is_fine() -> None:
    t = topology_from_dict({"model": MODEL, "pools": {
        "prefill": {"role": "prefill", "engine": "mocker", "engine_args": {"anything": [1, "x"]}},
        "decode": {"role": "decode", "engine": "mocker", "replicas": 2, "host": "gpu-2"},
    }}, "t.toml")
    assert t.hosts() == ["gpu-2", "local"]


def test_an_encode_pool_goes_with_agg_or_prefill_vllm_pools() -> None:
    """E/P/D: encode beside agg, and encode beside prefill + decode (the decode pool may be anything
    the prefill pool can hand KV to); the broken cases are fixtures (bad_encode_*)."""
    vlm = {"name": "m", "path": "tiny-vlm"}
    t = topology_from_dict({"model": vlm, "pools": {"enc": {"role": "encode", "replicas": 2},
                                                    "agg": {"role": "agg"}}}, "t.toml")
    assert [p.role for p in t.pools.values()] == ["encode", "agg"]
    t = topology_from_dict({"model": vlm, "pools": {"enc": {"role": "encode"}, "pf": {"role": "prefill"},
                                                    "dec": {"role": "decode"}}}, "t.toml")
    assert t.pools["enc"].engine == "vllm"
    with pytest.raises(TopologyError, match="pools.enc.role: an encode pool hands"):
        topology_from_dict({"model": vlm, "pools": {"enc": {"role": "encode"}, "dec": {"role": "decode"}}},
                           "t.toml")


def test_int_is_accepted_for_float_fields() -> None:
    t = topology_from_dict({"frontend": {"enabled": False}, "supervisor": {"period": 5}}, "t.toml")
    assert t.supervisor.period == 5.0


@pytest.mark.parametrize(("sets", "message"), [
    (["bus.auth.token=a", "bus.auth.user=u"], "bus.auth.user: choose one auth method; token is already set"),
    (["bus.auth.user=u", "bus.auth.password=p", "bus.auth.password_env=HOME"],
     "bus.auth.password_env: password is already set"),
    (["bus.auth.user=u"], "bus.auth.password: user and password go together"),
    (["bus.auth.token_file=/nonexistent/token"], "bus.auth.token_file: cannot read /nonexistent/token"),
    (["bus.auth.nkey_seed=/nonexistent/u.nk"], "bus.auth.nkey_seed: cannot read"),
    (["bus.auth.creds=/etc/hostname"], "bus.auth.creds: creds need an operator-mode server"),
    (["bus.auth.token=a", "bus.worker_auth.token=b"], "bus.worker_auth: a second user needs bus.server_config"),
    (["bus.tls.server_cert_file=/etc/hostname"], "server_cert_file and server_key_file go together"),
    (["bus.tls.verify_clients=true"], "bus.tls.verify_clients: needs server_cert_file"),
    (["frontend.api_key=a", "frontend.api_key_env=HOME"], "frontend.api_key_env: choose one"),
    (["frontend.api_key_env=VLLM_ACTORS_SURELY_UNSET"], "frontend.api_key_env: environment variable"),
    (["frontend.metrics_auth=true"], "frontend.metrics_auth: protects /metrics with the API key"),
])
def test_auth_and_secret_settings_are_checked_at_load(sets: list[str], message: str) -> None:
    """A secret that cannot be read is a usage error now, not a start retried until the root gives up."""
    with pytest.raises(TopologyError, match=re.escape(message)):
        load_topology(ROOT / "topologies" / "mocker-agg.toml", sets)


def test_worker_auth_with_server_config_and_secrets_by_file(tmp_path: Path) -> None:
    users = tmp_path / "users.conf"
    users.write_text("authorization { users = [] }\n")
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    t = load_topology(ROOT / "topologies" / "mocker-agg.toml", [
        f"bus.server_config={users}", "bus.auth.user=sup", f"bus.auth.password_file={pw}",
        "bus.worker_auth.user=wk", f"bus.worker_auth.password_file={pw}"])
    assert t.bus.auth.kind() == "user" and t.bus.worker_auth is not None and t.bus.worker_auth.user == "wk"


@pytest.mark.parametrize(("sets", "message"), [
    (["frontend.responses.ttl=0.5"], "frontend.responses.ttl: expected at least 1 second, got 0.5"),
    (["frontend.responses.max_bytes=0"], "frontend.responses.max_bytes: expected a number > 0, got 0"),
    (["frontend.responses.max_bytes=1000", "frontend.responses.max_entry_bytes=2000"],
     "frontend.responses.max_entry_bytes: expected at most max_bytes (1000), got 2000"),
])
def test_the_response_store_limits_are_checked_at_load(sets: list[str], message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        load_topology(ROOT / "topologies" / "mocker-agg.toml", sets)
    assert load_topology(ROOT / "topologies" / "mocker-agg.toml", []).frontend.responses.ttl == 86400.0


@pytest.mark.parametrize(("sets", "message"), [
    (["pools.agg.sleep.idle_stop=0"], "pools.agg.sleep.idle_stop: expected a number > 0, got 0"),
    (["frontend.cold.wake_timeout=0"], "frontend.cold.wake_timeout: expected a number > 0, got 0"),
    (["frontend.cold.max_held=0"], "frontend.cold.max_held: expected a number > 0, got 0"),
    (["frontend.cold.keepalive=-1"], "frontend.cold.keepalive: expected a number > 0, got -1"),
    (["planner.enabled=true", "planner.mode=load", "pools.agg.sleep.idle_stop=60"],
     "pools.agg.sleep.idle_stop: the planner keeps this pool at 1 replica(s) or more and would start again "
     "what idle_stop removes: set planner.pools.agg.min_replicas = 0 (or planner.min_replicas = 0)"),
])
def test_scale_to_zero_settings_are_checked_at_load(sets: list[str], message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        load_topology(ROOT / "topologies" / "mocker-agg.toml", sets)
    t = load_topology(ROOT / "topologies" / "mocker-agg.toml", ["pools.agg.sleep.idle_stop=60"])
    assert t.pools["agg"].sleep.idle_stop == 60.0 and t.frontend.cold.wake_timeout == 120.0
    t = load_topology(ROOT / "topologies" / "mocker-agg.toml", [
        "planner.enabled=true", "planner.mode=load", "planner.min_replicas=0", "pools.agg.sleep.idle_stop=60"])
    assert t.planner.min_replicas == 0
