"""How long a deployment started with the CLI takes to say it serves, and to exit after SIGTERM.

For each repeat: ``python -m actors.supervisor TOPOLOGY`` on free ports and a namespace of its own,
``/health`` polled every 50 ms until 200 (start), then SIGTERM and the wait for the root's exit
(stop: drain, children stopped, nats-server stopped, process gone). Prints one JSON line per
repeat and the medians.

    python bench/start_stop.py [--topology topologies/mocker-agg.toml] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.embedded import free_port  # noqa: E402


def once(topology: str, timeout: float) -> dict[str, float]:
    http, bus = free_port(), free_port()
    with tempfile.TemporaryDirectory() as run_dir, open(Path(run_dir) / "root.log", "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "actors.supervisor", topology,
                                 "--set", f"frontend.http=127.0.0.1:{http}", "--set", f"bus.port={bus}",
                                 "--set", f"namespace=bench{secrets.token_hex(3)}", "--set", f"run_dir={run_dir}"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None or time.monotonic() - t0 > timeout:
                    log.flush()
                    tail = (Path(run_dir) / "root.log").read_text(errors="replace")[-3000:]
                    raise SystemExit(f"{topology}: not serving (exit {proc.returncode}):\n{tail}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.05)
            t1 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout)
            t2 = time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"start_s": round(t1 - t0, 2), "stop_s": round(t2 - t1, 2), "exit_code": code}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default=str(ROOT / "topologies" / "mocker-agg.toml"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    runs = []
    for _ in range(args.repeats):
        runs.append(once(args.topology, args.timeout))
        print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({"topology": args.topology, "repeats": args.repeats,
                      "start_s_median": statistics.median(r["start_s"] for r in runs),
                      "stop_s_median": statistics.median(r["stop_s"] for r in runs)}))


if __name__ == "__main__":
    main()
