"""Reliability figures: faults and garbage against deployments started with the CLI; writes
docs/reliability.md.

Each scenario boots its own deployment (`python -m actors.supervisor topologies/mocker-agg.toml`
with `--set` overrides only for ports, namespace and what the scenario needs), runs, and stops it
with SIGTERM (exit code checked). Scenarios (tests/chaos/ holds them; the same code is asserted on
by `make test`):

- malformed HTTP: the issue's requests plus N hypothesis-drawn JSON bodies and raw HTTP
  (tests/chaos/http_fuzz.py);
- malformed NATS payloads on every subject the deployment serves, agg and kv router
  (tests/chaos/nats_fuzz.py);
- nats-server SIGKILL under 16 streams (plus 4 requests sent while the bus is down), `--runs` times;
- worker SIGKILL under 32 streams over 2 replicas, `--runs` times;
- a request of death (the mocker's poison_token_id SIGKILLs every worker that gets it);
- 500 slow clients (nothing sent, or one header line every 5 s);
- with `--vllm`: the issue's logprobs requests against vLLM-CPU (topologies/agg.toml).

Usage: .venv/bin/python bench/reliability.py [--runs 3] [--http-cases 2000] [--vllm]
       [--out docs/reliability.md] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.docs_section import keep_other_sections  # noqa: E402
from tests.chaos import scenarios as sc  # noqa: E402
from tests.chaos.http_fuzz import cap_memory, run_http_fuzz  # noqa: E402
from tests.chaos.nats_fuzz import run_nats_fuzz  # noqa: E402
from tests.e2e.conftest import Deployment  # noqa: E402


def deployment(name: str, topology: str, sets: list[str], ready: dict[str, int], tmp: Path,
               timeout: float = 120.0) -> Deployment:
    d = Deployment(topology, tmp / name, namespace=f"rel{name}{os.getpid()}", sets=sets)
    (tmp / name).mkdir(parents=True, exist_ok=True)
    d.start()
    try:
        d.wait_ready(ready, timeout)
    except BaseException:
        d.stop(20)
        raise
    return d


EXIT_CODES: dict[str, int] = {}  # each deployment's exit code after SIGTERM (0 = clean)


def with_deployment(name: str, topology: str, sets: list[str], ready: dict[str, int], tmp: Path,
                    run: Callable[[Deployment], Any]) -> Any:
    d = deployment(name, topology, sets, ready, tmp)
    try:
        return run(d)
    finally:
        rc = EXIT_CODES[name] = d.stop(60)
        if rc != 0:
            print(f"{name}: supervisor exit code {rc}\n{d.output(3000)}", file=sys.stderr)


def vllm_logprobs(d: Deployment) -> dict[str, Any]:
    out = {}
    for label, value in (("logprobs 100", 100), ("logprobs 2**63", 2 ** 63)):
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2, "logprobs": value}).encode()
        req = urllib.request.Request(f"{d.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                out[label] = {"status": r.status}
        except urllib.error.HTTPError as e:
            out[label] = {"status": e.code, "error": json.loads(e.read())["error"]["message"][:160]}
    return out


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}
    sc.raise_nofile(4096)
    with tempfile.TemporaryDirectory(prefix="reliability-") as t:
        tmp = Path(t)
        t0 = time.monotonic()
        def fuzz(d: Deployment) -> dict[str, Any]:
            assert d.proc is not None
            cap_memory(d.proc.pid)  # a case that still allocates without bound fails alone
            return run_http_fuzz(d.url, "tiny", cases=args.http_cases, seed=args.seed)

        res["http_fuzz"] = with_deployment(
            "http", "mocker-agg.toml", ["pools.agg.engine_args.max_model_len=512",
                                         "pools.agg.engine_args.speedup_ratio=0"], {"agg": 1}, tmp, fuzz)
        print(f"http fuzz: {time.monotonic() - t0:.0f}s", file=sys.stderr)
        for label, topo in (("agg", "mocker-agg.toml"), ("kv", "mocker-kv.toml")):
            res[f"nats_fuzz_{label}"] = with_deployment(
                f"nats{label}", topo, [], {}, tmp,
                lambda d: asyncio.run(run_nats_fuzz(d.bus_url, d.namespace, seed=args.seed)))
        print(f"nats fuzz: {time.monotonic() - t0:.0f}s", file=sys.stderr)

        res["faults"] = {"bus_kill": [], "worker_kill": []}
        for i in range(args.runs):
            last = i == args.runs - 1
            got = with_deployment(f"faults{i}", "mocker-agg.toml", sc.PAIR_SETS,
                                     {"agg": 2}, tmp, lambda d, last=last: faults_once(d, last))
            res["faults"]["bus_kill"] += got["bus_kill"]
            res["faults"]["worker_kill"] += got["worker_kill"]
            if "slow_clients" in got:
                res["faults"]["slow_clients"] = got["slow_clients"]
        print(f"faults: {time.monotonic() - t0:.0f}s", file=sys.stderr)
        res["request_of_death"] = with_deployment(
            "poison", "mocker-agg.toml", sc.POISON_SETS,
            {"agg": 2}, tmp, lambda d: asyncio.run(sc.request_of_death(d, poison=[5, sc.POISON, 6])))
        if args.vllm:
            res["vllm_logprobs"] = with_deployment("vllm", "agg.toml", [], {"agg": 1}, tmp, vllm_logprobs)
        res["seconds"] = round(time.monotonic() - t0)
        res["exit_codes"] = EXIT_CODES
    return res


def faults_once(d: Deployment, slow_clients: bool) -> dict[str, Any]:
    """One bus kill and one worker kill (and the slow clients once): a fresh deployment each time,
    as the root's restart intensity (5 in 60 s) counts the nats and worker restarts."""
    out: dict[str, Any] = {"bus_kill": [asyncio.run(sc.bus_kill_under_streams(d, streams=16))],
                           "worker_kill": [asyncio.run(sc.worker_kill_under_streams(d, streams=32))]}
    if slow_clients:
        out["slow_clients"] = asyncio.run(sc.slow_clients(d, connections=500))
    return out


# --- report ---------------------------------------------------------------------------------------
def _sum(runs: list[dict[str, Any]], part: str, key: str) -> int:
    return sum(r[part][key] for r in runs)


def _trim(res: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(res, default=str))
    out["http_fuzz"].pop("by_label", None)
    for label in ("agg", "kv"):
        n = out[f"nats_fuzz_{label}"]
        n["subjects"] = n["subjects"][:8] + ([f"... {len(n['subjects']) - 8} more"] if len(n["subjects"]) > 8 else [])
        n.pop("skipped_examples", None)
        n["examples"] = {k: v[:2] for k, v in n.get("examples", {}).items()}
    return out


def markdown(res: dict[str, Any], command: str) -> str:
    h = res["http_fuzz"]
    f = res["faults"]
    bk, wk = f["bus_kill"], f["worker_kill"]
    rod = res["request_of_death"]
    sl = f.get("slow_clients", {})
    lines = [
        "# Reliability",
        "",
        "Faults and garbage against deployments started with the project's CLI (mocker engine, default",
        "settings except ports, namespace and the scenario's own `--set`), as a client sees them.",
        "Scenario code: `tests/chaos/` (asserted on by `make test`); this file is written by",
        "`bench/reliability.py`.",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{res['seconds']} s in all.",
        "",
        "| scenario | acceptance | measured |",
        "|---|---|---|",
        f"| malformed HTTP ({h['cases']} requests: the issue's, hypothesis-drawn JSON bodies, raw HTTP) "
        f"| 0 responses ≥ 500; 0 non-OpenAI error bodies | {h['server_errors']} ≥ 500; "
        f"{h['bad_error_bodies']} bad bodies |",
    ]
    for label in ("agg", "kv"):
        n = res[f"nats_fuzz_{label}"]
        r = n["restarts"]
        lines.append(
            f"| malformed NATS payloads on every subject ({label} topology: {n['subjects_covered']} subjects, "
            f"{n['payloads_sent']} payloads) | 0 actor restarts | {r['restarts']} restarts "
            f"({len(r['registry_changed'])} registry records changed, {len(r['services_gone'])} services gone); "
            f"{n['server_errors']} replies ≥ 500, {n['timeouts']} unanswered; codes {n['codes']} |")
    lines += [
        f"| nats-server SIGKILL under 16 streams (+4 sent while down), {len(bk)} runs "
        f"| every stream completes or errors within the stall timeout (10 s); 0 hangs "
        f"| {_sum(bk, 'in_flight', 'completed') + _sum(bk, 'sent_while_down', 'completed')} of "
        f"{_sum(bk, 'in_flight', 'streams') + _sum(bk, 'sent_while_down', 'streams')} completed, "
        f"{_sum(bk, 'in_flight', 'hang') + _sum(bk, 'sent_while_down', 'hang')} hangs; "
        f"{_sum(bk, 'in_flight', 'exact') + _sum(bk, 'sent_while_down', 'exact')} token-exact; longest silence "
        f"{max(max(r['in_flight']['max_silence_s'], r['sent_while_down']['max_silence_s']) for r in bk)} s |",
        f"| worker SIGKILL under 32 streams, {len(wk)} runs | 0 failed streams "
        f"| {_sum(wk, 'streams', 'completed')} of {_sum(wk, 'streams', 'streams')} completed "
        f"({_sum(wk, 'streams', 'exact')} token-exact), {_sum(wk, 'streams', 'hang')} hangs; longest silence "
        f"{max(r['streams']['max_silence_s'] for r in wk)} s |",
        f"| request of death (kills every worker it reaches), sent twice, 8 ordinary requests beside it "
        f"| ≤ 2 worker restarts; the deployment keeps serving | {rod['worker_restarts']} restarts; first "
        f"{rod['first']['status']}, again {rod['again']['status']}; ordinary "
        f"{rod['ordinary_statuses'].count(200)}×200, {rod['bystanders_failed']} bystanders failed with it; "
        f"a new request after: {rod['served_after']} |",
        f"| {sl.get('connections', 0)} slow clients (nothing, or a header line every 5 s) "
        f"| closed within the header timeout (10 s) | {sl.get('closed')} closed, longest "
        f"{sl.get('max_closed_after_s')} s; statuses {sl.get('statuses')}; request meanwhile: "
        f"{sl.get('served_meanwhile')} |",
    ]
    if "vllm_logprobs" in res:
        v = res["vllm_logprobs"]
        lines.append("| vLLM-CPU: `logprobs` 100 and 2**63 | 400, not 500 | "
                     + "; ".join(f"{k}: {x['status']}" for k, x in v.items()) + " |")
    lines += ["", f"Every deployment stopped with exit code 0 after SIGTERM: {all(c == 0 for c in res['exit_codes'].values())} "
              f"({res['exit_codes']}).", "", "## Details", "",
              "Per-scenario figures as the scenarios return them (fuzz examples and subject lists trimmed).", "",
              "```json", json.dumps(_trim(res), indent=1, default=str), "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--http-cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm", action="store_true", help="also check the logprobs requests on vLLM-CPU")
    ap.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    ap.add_argument("--json")
    args = ap.parse_args()
    res = run_all(args)
    command = "python bench/reliability.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.write_text(keep_other_sections(out, markdown(res, command.strip())))  # e.g. chaos_repeats.py's
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "http_fuzz"}, default=str)[:3000])


if __name__ == "__main__":
    main()
