"""Issue 31's fault scenarios repeated many times (the suite runs each a few times): a mocker
deployment started with the CLI, then

- ``bus``: one worker; the embedded nats-server SIGKILLed and 4 requests sent at once, N rounds.
  Acceptance: every request answered within 15 s, 200 or 503 with Retry-After.
- ``poison``: two workers; a request of death beside 8 ordinary requests, N repeats. Acceptance:
  the 8 ordinary requests 200 every time, the poison refused (500, then 400 from quarantine).

The deployment gets ``supervisor.intensity=1000`` and ``supervisor.backoff.max=1``: N bus or worker
restarts within a minute would otherwise exhaust the root's restart intensity (5 in 60 s), which is
the supervisor doing its job, not what is measured. Writes the section "Repeated fault scenarios"
of docs/reliability.md (``bench/reliability.py`` keeps it).

    python bench/chaos_repeats.py [--rounds 20] [--only bus|poison] [--out docs/reliability.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402
from tests.chaos import scenarios as sc  # noqa: E402
from tests.e2e.conftest import Deployment  # noqa: E402

TITLE = "Repeated fault scenarios"
RESTARTS_ALLOWED = ["supervisor.intensity=1000", "supervisor.backoff.max=1"]


def deployment(which: str) -> Deployment:
    tmp = Path(tempfile.mkdtemp(prefix=f"chaosrep-{which}-"))
    sets = (sc.POISON_SETS if which == "poison" else []) + RESTARTS_ALLOWED
    d = Deployment("mocker-agg.toml", tmp, namespace=f"chaosrep{which}{int(time.time())}", sets=sets)
    d.start()
    d.wait_ready({"agg": 2 if which == "poison" else 1}, 90)
    return d


def bus(rounds: int) -> dict[str, Any]:
    d = deployment("bus")
    try:
        r = asyncio.run(sc.requests_as_the_bus_restarts(d, requests=4, rounds=rounds))
    finally:
        r_stop = d.stop(30)
    return {"rounds": rounds, "requests": r["requests"], "answered_in_time": r["answered_in_time"],
            "statuses": r["statuses"], "longest_s": r["max_seconds"], "late_or_bad": r["late_or_bad"],
            "worker_restarts": r["worker_restarts"], "stop_rc": r_stop}


def poison(repeats: int) -> dict[str, Any]:
    d = deployment("poison")
    runs: list[dict[str, Any]] = []
    try:
        for i in range(repeats):
            # a prompt of its own each time: a repeat must not be answered from the quarantine
            r = asyncio.run(sc.request_of_death(d, poison=[5, sc.POISON, 6 + i]))
            runs.append({"first": r["first"]["status"], "again": r["again"]["status"],
                         "ordinary_statuses": r["ordinary_statuses"], "served_after": r["served_after"]})
            asyncio.run(sc.wait_ready(d.url, 90))
    finally:
        r_stop = d.stop(30)
    good = [r for r in runs if r["ordinary_statuses"] == [200] * 8]
    return {"repeats": repeats, "ordinary_all_200": len(good),
            "first": sorted({r["first"] for r in runs}), "again": sorted({r["again"] for r in runs}),
            "served_after": sorted({r["served_after"] for r in runs}), "stop_rc": r_stop}


def markdown(res: dict[str, Any], command: str) -> str:
    rows = []
    if "bus" in res:
        b = res["bus"]
        rows.append(f"| one worker; nats-server SIGKILLed, 4 requests at once | every request answered within 15 s "
                    f"(200, or 503 + Retry-After) | {b['answered_in_time']} of {b['requests']} in {b['rounds']} "
                    f"rounds; statuses {', '.join(b['statuses'])}; longest {b['longest_s']} s |")
    if "poison" in res:
        p = res["poison"]
        rows.append(f"| two workers; a request of death beside 8 ordinary requests | the 8 ordinary requests "
                    f"200 every time | {p['ordinary_all_200']} of {p['repeats']}; the poison: "
                    f"{'/'.join(map(str, p['first']))} then {'/'.join(map(str, p['again']))}; "
                    f"a request after: {'/'.join(map(str, p['served_after']))} |")
    return (f"`{command}` ({time.strftime('%Y-%m-%d')}; a mocker deployment started with the CLI, "
            f"restart intensity raised so that the repeats do not exhaust it; 2 shared cores).\n\n"
            "| scenario | acceptance | result |\n|---|---|---|\n" + "\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--only", choices=("bus", "poison"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    args = ap.parse_args()
    res: dict[str, Any] = {}
    if args.only in (None, "bus"):
        res["bus"] = bus(args.rounds)
        print(json.dumps(res["bus"]), flush=True)
    if args.only in (None, "poison"):
        res["poison"] = poison(args.rounds)
        print(json.dumps(res["poison"]), flush=True)
    command = "python bench/chaos_repeats.py " + " ".join(sys.argv[1:])
    write_section(Path(args.out), TITLE, markdown(res, command.strip()))


if __name__ == "__main__":
    main()
