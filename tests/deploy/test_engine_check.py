"""The root checks every engine's configuration at its start, and ``--check`` too:
vLLM's config is built as each worker would build it, without the engine (no weights read), and a
rejection is exit 2 naming the setting. vLLM is imported in a process of its own, never in the
root. (No engine starts here: vLLM's config only.)"""

from __future__ import annotations

import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

from deploy.engine_check import check_engines
from tests.deploy.test_cli import cli
from tests.helpers import marked_env, processes_with

ROOT = Path(__file__).resolve().parents[2]
AGG = ROOT / "topologies" / "agg.toml"
MOCKER = ROOT / "topologies" / "mocker-agg.toml"


def test_check_refuses_an_engine_arg_vllm_rejects_naming_it() -> None:
    r = cli(str(AGG), "--check", "--set",
            "pools.agg.engine_args.structured_outputs_config={ disable_any_whitespace = true }", timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""  # no tree: nothing would start
    assert r.stderr.splitlines()[-1] == (
        f"error: {AGG}: pools.agg.engine_args.structured_outputs_config: bad structured_outputs_config: "
        "1 validation error for StructuredOutputsConfig: Value error, disable_any_whitespace is only "
        "supported for xgrammar and guidance backends. (set by --set)")
    # a rejection of vLLM's whole config (its ModelConfig) names the arg its message names
    r = cli(str(AGG), "--check", "--set", "pools.agg.engine_args.max_model_len=100000", timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"error: {AGG}: pools.agg.engine_args.max_model_len: vLLM rejected the engine args: "
                           "1 validation error for ModelConfig: Value error, User-specified max_model_len "
                           "(100000) is greater than the derived max_model_len"), last
    assert last.endswith("(set by --set)") and "input_value" not in last


def test_start_refuses_it_and_stops_what_it_started(tmp_path: Path) -> None:
    """Without --check: vLLM's check runs while the tree starts (not before: its import would delay
    every start by 10-30 s); its rejection stops the deployment, exit 2 with the setting named as
    the last line, and no process of the deployment is left."""
    mark = secrets.token_hex(6)  # on every process the deployment starts (tests.helpers.MARK)
    r = cli(str(AGG), "--set", "pools.agg.engine_args.dtype=float7", "--set", "bus.port=14399",
            "--set", "frontend.http=127.0.0.1:18399", "--set", f"run_dir={tmp_path}", timeout=300,
            env=marked_env(mark))
    assert r.returncode == 2, (r.stdout, r.stderr)
    # the error is the last line, after the shutdown's
    assert r.stderr.splitlines()[-1].startswith(
        f"error: {AGG}: pools.agg.engine_args.dtype: vLLM rejected the engine args: 2 validation errors for ModelConfig"), r.stderr[-3000:]
    assert "engine configuration rejected: " in r.stderr and "; stopping" in r.stderr
    left = processes_with(mark)
    assert not left, left


def test_a_mocker_start_refuses_it_before_anything_starts(tmp_path: Path) -> None:
    """The mocker's check runs in the root's process, before the bus, the frontend or any worker."""
    r = cli(str(MOCKER), "--set", "pools.agg.engine_args.bogus_arg=1", "--set", "bus.port=14398",
            "--set", "frontend.http=127.0.0.1:18398", "--set", f"run_dir={tmp_path}", timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines()[-1].startswith(f"error: {MOCKER}: pools.agg.engine_args"), r.stderr
    assert "starting" not in r.stderr and not list(tmp_path.iterdir())  # no nats-server store, nothing


def test_check_accepts_the_shipped_vllm_topology() -> None:
    r = cli(str(AGG), "--check", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "worker-agg-0 [permanent" in r.stdout


def test_mocker_args_are_checked_in_process() -> None:
    r = cli(str(MOCKER), "--check", "--set", "pools.agg.engine_args.bogus_arg=1")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1].startswith(
        f"error: {MOCKER}: pools.agg.engine_args: mocker engine args: unknown mocker engine arg 'bogus_arg' (known: ")
    assert r.stderr.splitlines()[-1].endswith("(set by --set)")


def test_check_engines_skips_pools_of_other_hosts() -> None:
    from config.loader import load_topology

    t = load_topology(MOCKER, ["pools.agg.engine_args.bogus_arg=1", "pools.agg.host=gpu"])
    check_engines(t, ["local"], str(MOCKER))  # not this share's pool: not checked here


def test_vllm_config_check_reads_no_weights_and_starts_no_process() -> None:
    """The check opens the model's config files but no weight file, and leaves no child process."""
    code = textwrap.dedent("""
        import sys, multiprocessing
        opened = []
        sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args else None)
        from config.loader import load_topology
        from actors.worker.engine_factory import check_engine_config
        check_engine_config(load_topology("topologies/agg.toml"), "agg")
        weights = [p for p in opened if p.endswith((".safetensors", ".bin", ".pt", ".pth"))]
        configs = [p for p in opened if p.endswith("tiny-llama/config.json")]
        import psutil
        print("weights", weights, "configs", bool(configs), "children", psutil.Process().children())
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "weights [] configs True children []", r.stdout


def test_the_root_never_imports_vllm_and_an_unreadable_model_is_not_a_rejection() -> None:
    """vLLM runs in the check's own process; a model that cannot be read now (a missing path, an
    unreachable hub: OSError) is logged as unchecked and left to the workers, not refused."""
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        from config.loader import load_topology
        from deploy.engine_check import check_engines
        check_engines(load_topology("topologies/agg.toml", ["model.path=/nonexistent/model"]), ["local"], "agg.toml")
        print("vllm imported:", "vllm" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == "vllm imported: False", r.stdout
    assert lines[-2].startswith("pools.agg: engine configuration unchecked: OSError: "), r.stdout
