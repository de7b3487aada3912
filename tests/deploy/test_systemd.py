"""Unit generation: content, quoting, and ``systemd-analyze verify`` with empty stderr."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from config.loader import load_topology, topology_from_dict
from deploy.systemd import emit_units, quote_arg

ROOT = Path(__file__).resolve().parents[2]
ECHO = ROOT / "topologies" / "echo.toml"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (make test installs it: apt-get install systemd)")

MULTI = """
namespace = "prod"
[bus]
url = "nats://nats-1.internal:4222,nats://nats-2.internal:4222"
[model]
name = "m"
path = "tiny"
[frontend]
host = "edge"
[pools.prefill]
role = "prefill"
engine = "mocker"
host = "gpu-a"
[pools.decode]
role = "decode"
engine = "mocker"
host = "gpu-b"
replicas = 2
[systemd]
user = "root"
environment_file = "/etc/vllm-actors/prod.env"
working_directory = "/"
watchdog_sec = 120
restart_sec = 7
start_limit_interval_sec = 600
start_limit_burst = 3
timeout_stop_sec = 45
timeout_start_sec = 1800
"""


def _parse(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=False)
    cp.optionxform = str  # type: ignore[assignment]  # keys are case-sensitive in systemd
    cp.read(path)
    return cp


def _verify(paths: list[Path]) -> None:
    proc = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, paths)], capture_output=True, text=True,
                          timeout=60)
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 0, proc.stdout


def test_embedded_topology_gets_nats_unit_and_host_depends_on_it(tmp_path: Path) -> None:
    t = load_topology(ECHO, ["bus.port=4999"])
    paths = emit_units(t, ECHO, tmp_path)
    assert [p.name for p in paths] == ["vllm-actors-echo-nats.service", "vllm-actors-echo-local.service"]
    nats, host = (_parse(p) for p in paths)
    argv = nats["Service"]["ExecStart"].split()
    assert Path(argv[0]).name == "nats-server" and Path(argv[0]).is_absolute()
    conf = tmp_path.resolve() / "vllm-actors-echo-nats.conf"
    assert argv[1:] == ["-c", str(conf), "-js", "-sd", "/var/lib/vllm-actors/echo/nats", "-a", "127.0.0.1",
                        "-p", "4999", "-n", "echo-nats"]
    assert conf.read_text() == "max_payload: 8388608\n"  # the same settings as the embedded server
    assert nats["Service"]["StateDirectory"] == "vllm-actors/echo/nats"
    svc = host["Service"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "all"
    assert svc["ExecStart"] == (f"{sys.executable} -m actors.supervisor {ECHO} --host local "
                                "--set bus.url=nats://127.0.0.1:4999")
    assert host["Unit"]["Requires"] == "vllm-actors-echo-nats.service"
    assert "vllm-actors-echo-nats.service" in host["Unit"]["After"].split()
    assert (svc["Restart"], svc["KillMode"], svc["WatchdogSec"]) == ("on-failure", "mixed", "30")
    assert "EnvironmentFile" not in svc and "User" not in svc
    assert svc["TimeoutStartSec"] == "infinity"


def test_nats_unit_enforces_the_topology_auth(tmp_path: Path) -> None:
    """The generated nats unit's server admits what the embedded one would: the token, nobody else
    (started from the unit's own ExecStart, on a free port)."""
    import asyncio
    import stat

    from bus.connection import connect
    from bus.embedded import free_port
    from config.topology import BusAuth, BusConfig

    token = tmp_path / "token"
    token.write_text("unit-token\n")
    port = free_port()
    t = load_topology(ECHO, [f"bus.port={port}", f"bus.auth.token_file={token}",
                             f"bus.store_dir={tmp_path / 'store'}"])
    paths = emit_units(t, ECHO, tmp_path / "units")
    conf = (tmp_path / "units").resolve() / "vllm-actors-echo-nats.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    argv = _parse(paths[0])["Service"]["ExecStart"].split()
    assert "unit-token" not in " ".join(argv)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def check() -> None:
        for _ in range(100):
            try:
                nc = await connect(BusConfig(url=f"nats://127.0.0.1:{port}", auth=BusAuth(token="unit-token")),
                                   "unit-test", initial_attempts=1)
                break
            except Exception:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the unit's nats-server did not admit the topology's token")
        await nc.close()
        with pytest.raises(Exception):  # noqa: B017 - nats-py raises several auth error types
            await connect(BusConfig(url=f"nats://127.0.0.1:{port}"), "anon", initial_attempts=1)
    try:
        asyncio.run(check())
    finally:
        proc.terminate()
        proc.wait(10)


def test_multi_host_with_url_has_no_nats_unit(tmp_path: Path) -> None:
    topo_file = tmp_path / "prod.toml"
    topo_file.write_text(MULTI)
    t = load_topology(topo_file)
    paths = emit_units(t, topo_file, tmp_path / "units", python=sys.executable)
    assert sorted(p.name for p in paths) == [
        "vllm-actors-prod-edge.service", "vllm-actors-prod-gpu-a.service", "vllm-actors-prod-gpu-b.service"]
    unit = _parse(tmp_path / "units" / "vllm-actors-prod-gpu-b.service")
    svc, head = unit["Service"], unit["Unit"]
    assert svc["ExecStart"].endswith(f"-m actors.supervisor {topo_file} --host gpu-b")
    assert "--set" not in svc["ExecStart"] and "Requires" not in head
    assert svc["EnvironmentFile"] == "-/etc/vllm-actors/prod.env"
    assert (svc["User"], svc["WorkingDirectory"], svc["WatchdogSec"], svc["RestartSec"]) == ("root", "/", "120", "7")
    assert (svc["TimeoutStopSec"], head["StartLimitIntervalSec"], head["StartLimitBurst"]) == ("45", "600", "3")
    assert svc["TimeoutStartSec"] == "1800"


@pytest.mark.parametrize(("arg", "quoted"), [
    ("/plain/path.toml", "/plain/path.toml"),
    ("/with space/t.toml", '"/with space/t.toml"'),
    ("/pct%d/t.toml", "/pct%%d/t.toml"),
    ("$HOME", "$$HOME"),
    ('a"b', '"a\\"b"'),
])
def test_quote_arg(arg: str, quoted: str) -> None:
    assert quote_arg(arg) == quoted


@needs_systemd
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    _verify(emit_units(load_topology(ECHO), ECHO, tmp_path / "echo"))
    topo_file = tmp_path / "prod.toml"
    topo_file.write_text(MULTI)
    _verify(emit_units(load_topology(topo_file), topo_file, tmp_path / "prod"))


@needs_systemd
def test_awkward_paths_still_verify(tmp_path: Path) -> None:
    odd = tmp_path / "dir with space %n"
    odd.mkdir()
    topo_file = odd / "echo.toml"
    topo_file.write_text(ECHO.read_text())
    t = load_topology(topo_file, [f"bus.store_dir={odd / 'store'}", f"systemd.working_directory={odd}"])
    paths = emit_units(t, topo_file, tmp_path / "units")
    _verify(paths)
    assert '"' + str(odd).replace("%", "%%") in _parse(paths[0])["Service"]["ExecStart"]


@needs_systemd
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """Guards the verify test itself: a bad key must show up on stderr."""
    paths = emit_units(topology_from_dict({"frontend": {"enabled": False}, "echo": True}), ECHO, tmp_path)
    paths[-1].write_text(paths[-1].read_text().replace("[Service]\n", "[Service]\nTypo=1\n"))
    proc = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, paths)], capture_output=True, text=True,
                          timeout=60)
    assert "Unknown key 'Typo'" in proc.stderr
