"""The profiler as a user runs it: ``python -m actors.planner.profile TOPOLOGY --pool X`` against a
mocker pool, the profile file read back as the planner reads it (msgspec, ``Profile``).

Each run is given an environment marker that its worker and nats-server inherit, so the test can
tell that none of them outlives the run (also after a Ctrl-C). The planning and prompt helpers are
checked directly.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from actors.planner.contract import Profile
from actors.planner.profile import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, made_by
from actors.planner.sweep import Limits, Point, Prompts, Sweep, plan
from tests.helpers import assert_nothing_left, marked_env, processes_with

ROOT = Path(__file__).resolve().parents[2]
AGG = str(ROOT / "topologies" / "mocker-agg.toml")
DISAGG = str(ROOT / "topologies" / "mocker-disagg.toml")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "actors.planner.profile", *args]


def run(args: list[str], mark: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), cwd=ROOT, env=marked_env(mark), capture_output=True, text=True,
                          timeout=90)


def test_profile_of_a_mocker_agg_pool(tmp_path: Path) -> None:
    out = tmp_path / "agg.json"
    mark = secrets.token_hex(6)
    args = [AGG, "--pool", "agg", "--set", "pools.agg.engine_args.speedup_ratio=1",
            "--isl", "64,2048", "--concurrency", "1,4", "--osl", "16", "--requests-per-point", "8",
            "--out", str(out)]
    r = run(args, mark)
    assert r.returncode == EXIT_OK, r.stderr
    assert_nothing_left(mark)
    assert r.stdout.strip().endswith(f"wrote {out}")
    p = msgspec.json.decode(out.read_bytes(), type=Profile)
    assert (p.pool, p.role, p.engine, p.model) == ("agg", "agg", "mocker", "tiny")
    assert p.made_by == "python -m actors.planner.profile " + " ".join(args)
    # the mocker's engine args in the topology: 16384 blocks of 16 tokens, 256 sequences
    assert (p.kv_capacity_tokens, p.max_num_seqs) == (16384 * 16, 256)
    assert sorted((x.isl, x.concurrency) for x in p.prefill) == [(64, 1), (64, 4), (2048, 1), (2048, 4)]
    # a decode point's context is its prompt plus half the output
    assert sorted((x.context, x.concurrency) for x in p.decode) == [(72, 1), (72, 4), (2056, 1), (2056, 4)]
    ttft = {(x.isl, x.concurrency): x.ttft_ms for x in p.prefill}
    for c in (1, 4):
        # the mocker's prefill time grows with the tokens of the step (17.5 ms for 64, 49 ms for 2048)
        assert ttft[(2048, c)] > ttft[(64, c)]
    assert all(x.tokens_per_s > 0 for x in p.prefill)
    assert all(x.itl_ms > 0 and x.tokens_per_s > 0 for x in p.decode)


def test_a_prefill_pool_gets_prefill_points_in_the_planners_file(tmp_path: Path) -> None:
    """No --out: the file lands where the planner looks (<run_dir>/profiles/<pool>.json)."""
    mark = secrets.token_hex(6)
    r = run([DISAGG, "--pool", "prefill", "--set", f"run_dir={tmp_path}", "--isl", "32,128",
             "--concurrency", "1,2", "--requests-per-point", "4"], mark)
    assert r.returncode == EXIT_OK, r.stderr
    assert_nothing_left(mark)
    p = msgspec.json.decode((tmp_path / "profiles" / "prefill.json").read_bytes(), type=Profile)
    assert p.role == "prefill"
    assert sorted((x.isl, x.concurrency) for x in p.prefill) == [(32, 1), (32, 2), (128, 1), (128, 2)]
    assert p.decode == []


def test_unknown_pool_is_a_usage_error(tmp_path: Path) -> None:
    mark = secrets.token_hex(6)
    r = run([AGG, "--pool", "nope", "--out", str(tmp_path / "x.json")], mark)
    assert r.returncode == EXIT_USAGE
    assert "no pool 'nope'" in r.stderr and "pools: agg" in r.stderr
    assert not (tmp_path / "x.json").exists()
    assert_nothing_left(mark)


def test_ctrl_c_stops_the_worker_and_the_server(tmp_path: Path) -> None:
    mark = secrets.token_hex(6)
    out = tmp_path / "agg.json"
    # slowed down so that the sweep is still running when the signal comes
    proc = subprocess.Popen(cli(AGG, "--pool", "agg", "--set", "pools.agg.engine_args.speedup_ratio=0.1",
                                "--out", str(out)),
                            cwd=ROOT, env=marked_env(mark), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        header = proc.stdout.readline()  # printed once the worker serves and the sweep starts
        assert header.startswith("point"), proc.stderr.read() if proc.stderr else header
        assert processes_with(mark)  # the worker and the server run
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "no profile written" in err
    assert not out.exists()
    assert_nothing_left(mark)


# --- the sweep's plan and prompts -----------------------------------------------------------------------
def test_points_that_cannot_fit_are_skipped_with_the_reason() -> None:
    run_, skipped = plan(Sweep(isls=[100, 1000], concurrencies=[1, 8], osl=100),
                         Limits(max_model_len=1050, kv_capacity_tokens=4000, max_num_seqs=4))
    assert run_ == [Point("prefill", 100, 1), Point("prefill", 1000, 1), Point("decode", 100, 1)]
    reasons = {(p.kind, p.isl, p.concurrency): why for p, why in skipped}
    assert reasons[("prefill", 100, 8)] == "concurrency 8 > max_num_seqs 4"
    assert reasons[("decode", 1000, 1)] == "1100 tokens per request > max_model_len 1050"
    _, skipped = plan(Sweep(isls=[1000], concurrencies=[4], osl=100, prefill=False),
                      Limits(max_model_len=2000, kv_capacity_tokens=4000, max_num_seqs=8))
    assert skipped[0][1] == "4 x 1100 tokens > KV capacity 4000 tokens"


def test_prompts_share_no_prefix_and_avoid_the_given_ids() -> None:
    prompts = Prompts(vocab_size=50, avoid=frozenset({20}), seed=1)
    made = [prompts.make(16) for _ in range(1500)]
    assert all(len(p) == 16 for p in made)
    assert len({tuple(p[:2]) for p in made}) == len(made)  # first two tokens differ pairwise
    assert all(20 not in p and min(p) >= 10 for p in made)


@pytest.mark.parametrize(("argv", "shown"), [
    (["t.toml", "--set", "bus.auth.password=hunter2"], "--set 'bus.auth.password=***'"),
    (["t.toml", "--set=bus.auth.token=x"], "'--set=bus.auth.token=***'"),
    (["t.toml", "--set", "pools.a.replicas=2"], "--set pools.a.replicas=2"),
])
def test_made_by_hides_secret_overrides(argv: list[str], shown: str) -> None:
    assert made_by(argv) == "python -m actors.planner.profile t.toml " + shown
