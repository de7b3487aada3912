"""Frontend at zero compute, ours vs NVIDIA Dynamo 1.6.1, measured in one run on one box.

For each stack (ours: `actors.supervisor topologies/mocker-agg.toml`, Dynamo: `dynamo.frontend` +
`dynamo.mocker` as in the peer kit's up.sh, but on free ports) and each routing mode (round_robin
with 1 mocker worker, kv with 4), one after another:

1. start the stack, wait until /v1/models lists the model;
2. warm up with wrk (same settings, --warmup seconds);
3. read CPU (utime+stime from /proc) of the frontend process and of the whole stack tree;
4. wrk -t1 -c32 -d15s with the peer kit's chat.lua (~130-token chat prompts, 4 streamed tokens);
5. read CPU again; requests/s and CPU ms per request come from the differences;
6. stop the stack (SIGINT, SIGKILL after a grace period), check nothing is left.

Ours: the frontend lives in the supervisor root process, so "frontend CPU" = the root's own CPU;
workers and nats-server are its children. Dynamo: "frontend CPU" = the dynamo.frontend process;
stack = nats-server + frontend + mocker trees (what the peer's tree_cpu.py sums).

Where the programs outside this repository are (nothing is assumed about this machine's layout):

- ``--peer-dir DIR`` or ``$PEER_DIR``: the peer kit (its ``chat.lua`` drives wrk for both stacks);
  required.
- ``--dynamo-venv DIR`` or ``$DYNVV``: Dynamo's virtualenv (``bin/python`` with ``dynamo``,
  ``bin/nats-server``); required unless ``--only ours``.
- ``--model-dir DIR`` or ``$MODEL``: the tiny model Dynamo's mocker reads; default: where
  ``actors.models.tiny`` builds it (``$VLLM_ACTORS_HOME/models/tiny-llama``).
- ``wrk`` on ``$PATH``.

``--tracing off,1,0.01`` measures our stack once per value: tracing off (the default topology),
and on with that ``tracing.sample_ratio``, exporting to an OTLP/HTTP receiver in this process that
decodes and counts the spans (tests/otlp_receiver.py; a collector's CPU is not the stack's).

``--per-process`` prints each stack's per-process table (CPU per request and per output token of the
frontend, the workers, the engines, nats-server); ``--profile`` adds py-spy's top frames of each
Python process (bench/proc_profile.py).

Usage: .venv/bin/python bench/frontend_bench.py --peer-dir DIR [--dynamo-venv DIR] [--rounds 2]
       [--duration 15] [--json out.json] [--per-process | --profile]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.otlp_receiver
from proc_cpu import kill_leftovers, own_cpu, tree, tree_cpu  # noqa: E402
from proc_profile import ProcessProfile  # noqa: E402

from actors.models.tiny import tiny_model_dir  # noqa: E402
from bus.embedded import free_port  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 4  # streamed output tokens per request (chat.lua's MAX_TOKENS)


@dataclass(frozen=True)
class Peer:
    """The programs outside this repository, as given by arguments or the environment."""

    chat_lua: Path  # the peer kit's wrk script
    dynamo_venv: Path | None  # None: only our stack runs
    model_dir: Path
    baseline: Path | None = None  # another checkout of ours, measured as stack "base"


@dataclass
class Result:
    stack: str
    mode: str
    workers: int
    processes: int  # our frontend's processes (frontend.processes); 1 for Dynamo
    tracing: str  # "off", or the sample ratio our stack ran with (``--tracing``)
    requests: int
    errors: int
    seconds: float
    rps: float
    latency_avg: str
    frontend_cpu_s: float
    stack_cpu_s: float
    wrk_cpu_s: float
    machine_busy_s: float            # all CPUs, from /proc/stat, during the window
    loadavg_before: str
    per_process_cpu_s: dict[str, float] = field(default_factory=dict)
    profile_table: str = ""
    spans: int = 0  # spans the OTLP receiver took during the measured window

    @property
    def frontend_ms_per_req(self) -> float:
        return 1000 * self.frontend_cpu_s / max(self.requests, 1)

    @property
    def stack_ms_per_req(self) -> float:
        return 1000 * self.stack_cpu_s / max(self.requests, 1)


def machine_busy() -> float:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_up(port: int, procs: list[subprocess.Popen], timeout: float = 180, poll: float = 0.5) -> float:
    """Seconds until /v1/models on ``port`` lists the tiny model; fails early if a process exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"pid {p.pid} exited with {p.returncode} before the stack was up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if b'"tiny"' in r.read():
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(poll)
    raise RuntimeError(f"stack on :{port} not up after {timeout}s")


def run_wrk(port: int, seconds: int, conns: int, chat_lua: Path) -> tuple[str, float]:
    env = dict(os.environ, MAX_TOKENS=str(TOKENS), STREAM="true", MODEL_NAME="tiny")
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "-s", str(chat_lua),
           f"http://127.0.0.1:{port}"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cpu = 0.0
    out_chunks = []
    # sample wrk's CPU just before it exits (a reaped child's /proc entry is gone)
    while p.poll() is None:
        c = own_cpu(p.pid)
        cpu = c or cpu
        time.sleep(0.2)
    out_chunks.append(p.stdout.read() if p.stdout else "")
    return "".join(out_chunks), cpu


def parse_wrk(out: str) -> tuple[int, int, float, float, str]:
    m = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m)", out)
    if not m:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    n = int(m.group(1))
    secs = float(m.group(2)) * {"ms": 1e-3, "s": 1.0, "m": 60.0}[m.group(3)]
    errs = 0
    for pat in (r"Non-2xx or 3xx responses: (\d+)", r"Socket errors: connect (\d+), read (\d+), "
                r"write (\d+), timeout (\d+)"):
        mm = re.search(pat, out)
        if mm:
            errs += sum(int(g) for g in mm.groups())
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = re.search(r"Latency\s+(\S+)", out)
    return n, errs, secs, rps, lat.group(1) if lat else "?"


class Stack:
    port: int
    procs: list[subprocess.Popen]
    frontend_pid: int

    def roots(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, grace: float = 20.0) -> None:
        pids = [q for r in self.roots() for q in tree(r)]
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        time.sleep(0.5)
        kill_leftovers(pids)


class Ours(Stack):
    """Our stack from this checkout, or from ``tree`` (another checkout of the project, e.g. a
    ``git worktree`` of the commit before a change: ``--baseline DIR``), with this checkout's venv."""

    def __init__(self, mode: str, workers: int, logdir: Path, tree: Path = ROOT, processes: int = 1,
                 sets: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.processes = processes
        bus = free_port()
        ns = f"fb{os.getpid()}{mode[:2]}"
        cmd = [str(ROOT / ".venv/bin/python"), "-m", "actors.supervisor",
               str(tree / "topologies/mocker-agg.toml"), "--set", f"bus.port={bus}",
               "--set", f"frontend.http=127.0.0.1:{self.port}", "--set", f"frontend.router={mode}",
               "--set", f"namespace={ns}", "--set", f"run_dir={logdir / 'run'}",
               "--set", f"pools.agg.replicas={workers}", "--log-level", "WARNING"]
        if processes > 1:
            cmd += ["--set", f"frontend.processes={processes}"]
        cmd += [a for kv in sets for a in ("--set", kv)]
        self.cmd = cmd
        log = open(logdir / "ours.log", "w")
        env = dict(os.environ, PYTHONPATH=str(tree))  # its packages, not the venv's editable install
        self.procs = [subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)]
        self.frontend_pid = self.procs[0].pid

    def frontend_pids(self) -> list[int]:
        """The root (it accepts and hands connections over) and, with several, the frontend
        processes (and their idle standby)."""
        pids = [self.frontend_pid]
        for pid in tree(self.frontend_pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"actors.frontend.process" in cmd:
                pids.append(pid)
        return pids

    def wait_all_frontends(self, timeout: float = 120) -> None:
        """Until one scrape of /metrics has every frontend process's answer."""
        end = time.monotonic() + timeout
        while self.processes > 1 and time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                    if re.search(rb"^vllm_actors_frontend_scrape_missing 0\.0$", r.read(), re.M):
                        return
            except OSError:
                pass
            time.sleep(0.5)
        if self.processes > 1:
            raise RuntimeError(f"not every frontend process answers after {timeout}s")


class Dynamo(Stack):
    """up.sh's commands with the HTTP and NATS ports made free ones (up.sh hard-codes 8000)."""

    def __init__(self, mode: str, workers: int, logdir: Path, venv: Path, model_dir: Path,
                 speedup: str = "1000000", mocker_args: tuple[str, ...] = ()) -> None:
        # mocker_args: more ``dynamo.mocker`` flags (a repeated flag's last value wins)
        self.port = free_port()
        nats_port = free_port()
        env = dict(os.environ, DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(logdir / "kv"),
                   DYN_REQUEST_PLANE="tcp", DYN_EVENT_PLANE="nats",
                   NATS_SERVER=f"nats://127.0.0.1:{nats_port}", DYN_TCP_RPC_HOST="127.0.0.1",
                   DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1",
                   DYN_SYSTEM_HOST="127.0.0.1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   DYN_LOG="warn")
        (logdir / "kv").mkdir(parents=True, exist_ok=True)
        py = str(venv / "bin/python")

        def spawn(name: str, cmd: list[str]) -> subprocess.Popen:
            return subprocess.Popen(cmd, env=env, stdout=open(logdir / f"{name}.log", "w"),
                                    stderr=subprocess.STDOUT)

        nats = spawn("nats", [str(venv / "bin/nats-server"), "-a", "127.0.0.1", "-p", str(nats_port),
                              "-js", "-sd", str(logdir / "js")])
        time.sleep(1)
        fe = spawn("frontend", [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                "--http-port", str(self.port), "--router-mode", mode])
        mk = spawn("mocker", [py, "-m", "dynamo.mocker", "--model-path", str(model_dir),
                              "--model-name", "tiny", "--num-workers", str(workers),
                              "--speedup-ratio", speedup, "--block-size", "16", *mocker_args])
        self.procs = [nats, fe, mk]
        self.frontend_pid = fe.pid
        self.cmd = fe.args + ["&&"] + mk.args


def measure(kind: str, mode: str, workers: int, duration: int, warmup: int, conns: int,
            peer: Peer, per_process: bool = False, spy: bool = False, processes: int = 1,
            tracing: str = "off", sink: OtlpReceiver | None = None) -> Result:
    logdir = Path(tempfile.mkdtemp(prefix=f"fbench-{kind}-{mode}-"))
    if kind == "ours":
        sets = () if tracing == "off" or sink is None else (f"tracing.endpoint={sink.endpoint}",
                                                             f"tracing.sample_ratio={tracing}")
        stack: Stack = Ours(mode, workers, logdir, processes=processes, sets=sets)
    elif kind == "base":
        assert peer.baseline is not None
        stack = Ours(mode, workers, logdir, tree=peer.baseline)
    else:
        assert peer.dynamo_venv is not None  # main() refuses to run Dynamo without it
        stack = Dynamo({"round_robin": "round-robin"}.get(mode, mode), workers, logdir,
                       peer.dynamo_venv, peer.model_dir)
    try:
        up = wait_up(stack.port, stack.procs)
        if isinstance(stack, Ours):
            stack.wait_all_frontends()
        fe_pids = stack.frontend_pids() if isinstance(stack, Ours) else [stack.frontend_pid]
        kind_n = f"{kind} {processes}p" + (f" tracing {tracing}" if tracing != "off" else "") \
            if kind == "ours" else kind
        print(f"[{kind_n} {mode} x{workers}] up after {up:.1f}s on :{stack.port} (logs {logdir})",
              file=sys.stderr)
        out, _ = run_wrk(stack.port, warmup, conns, peer.chat_lua)
        n_w, e_w, *_ = parse_wrk(out)
        if n_w == 0 or e_w:
            raise RuntimeError(f"warm-up failed ({n_w} requests, {e_w} errors):\n{out}")
        time.sleep(1)
        fe0, st0, busy0 = sum(own_cpu(p) for p in fe_pids), tree_cpu(*stack.roots()), machine_busy()
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        spans0 = sink.count if sink is not None else 0
        with ProcessProfile(stack.roots(), spy=spy, out_dir=logdir / "spy") as prof:
            out, wrk_cpu = run_wrk(stack.port, duration, conns, peer.chat_lua)
        spans = sink.count - spans0 if sink is not None else 0
        fe1, st1, busy1 = sum(own_cpu(p) for p in fe_pids), tree_cpu(*stack.roots()), machine_busy()
        per = prof.by_role()
        n, errs, secs, rps, lat = parse_wrk(out)
        r = Result(kind, mode, workers, processes if kind == "ours" else 1, tracing if kind == "ours" else "off",
                   n, errs, secs, rps, lat, fe1 - fe0, st1 - st0, wrk_cpu, busy1 - busy0, load, per,
                   prof.table(n, n * TOKENS, f"{kind} {mode}, {workers} worker(s)") if per_process else "",
                   spans)
        print(f"[{kind_n} {mode} x{workers}] {rps:.0f} req/s, {n} req, {errs} errors, lat {lat}, "
              f"frontend {r.frontend_ms_per_req:.2f} ms/req, stack {r.stack_ms_per_req:.2f} ms/req, "
              f"per-process {per}, spans {spans}, wrk {wrk_cpu:.1f}s, machine busy {r.machine_busy_s:.1f}s "
              f"of {2 * secs:.0f}s, load {load}", file=sys.stderr)
        return r
    finally:
        stack.stop()


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--duration", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--kv-workers", type=int, default=4)
    ap.add_argument("--rr-workers", type=int, default=1)
    ap.add_argument("--only", choices=["ours", "dynamo"], default=None)
    ap.add_argument("--tracing", default="off",
                    help="our stack once per value: off, or a tracing.sample_ratio (e.g. off,1,0.01)")
    ap.add_argument("--frontend-processes", default="1",
                    help="our frontend's processes to measure, comma-separated (e.g. 1,2,4): each is a stack")
    ap.add_argument("--modes", default="round_robin,kv")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--per-process", action="store_true",
                    help="print CPU per request and per output token of each process of each stack")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout of this project (git worktree add DIR COMMIT), run as stack "
                         "'base' before ours in every round: what a change bought, in the same run")
    ap.add_argument("--profile", action="store_true",
                    help="--per-process, plus py-spy records of each Python process and their top frames")
    ap.add_argument("--peer-dir", type=Path, default=_env_path("PEER_DIR"),
                    help="the peer kit (chat.lua); default $PEER_DIR")
    ap.add_argument("--dynamo-venv", type=Path, default=_env_path("DYNVV"),
                    help="Dynamo's virtualenv (bin/python, bin/nats-server); default $DYNVV")
    ap.add_argument("--model-dir", type=Path, default=_env_path("MODEL") or tiny_model_dir(),
                    help="the tiny model for Dynamo's mocker; default $MODEL, else the project's build")
    a = ap.parse_args()
    if a.peer_dir is None:
        ap.error("where is the peer kit? give --peer-dir or set PEER_DIR")
    if a.only != "ours" and a.dynamo_venv is None:
        ap.error("where is Dynamo's venv? give --dynamo-venv or set DYNVV (or run --only ours)")
    peer = Peer(a.peer_dir / "chat.lua", a.dynamo_venv, a.model_dir, a.baseline)
    results: list[Result] = []
    tracings = a.tracing.split(",")
    sink = OtlpReceiver(keep=False).__enter__() if tracings != ["off"] else None
    for _ in range(a.rounds):
        for mode in a.modes.split(","):
            workers = a.kv_workers if mode == "kv" else a.rr_workers
            for kind in ("base", "ours", "dynamo"):
                if (a.only and kind != a.only and not (kind == "base" and a.only == "ours")
                        or kind == "base" and a.baseline is None):
                    continue
                for n in ([int(x) for x in a.frontend_processes.split(",")] if kind == "ours" else [1]):
                    for tr in (tracings if kind == "ours" else ["off"]):
                        results.append(measure(kind, mode, workers, a.duration, a.warmup, a.connections, peer,
                                               per_process=a.per_process or a.profile, spy=a.profile, processes=n,
                                               tracing=tr, sink=sink))
    print("\n| stack | mode | workers | frontend processes | tracing | spans | req/s | errors | frontend CPU ms/req |"
          " stack CPU ms/req | per-process CPU s | machine busy s | load before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.stack} | {r.mode} | {r.workers} | {r.processes} | {r.tracing} | {r.spans} | {r.rps:.0f} | {r.errors} | "
              f"{r.frontend_ms_per_req:.2f} | {r.stack_ms_per_req:.2f} | {r.per_process_cpu_s} | "
              f"{r.machine_busy_s:.1f} / {2 * r.seconds:.0f} | {r.loadavg_before} |")
    for mode in a.modes.split(","):
        med = lambda xs: statistics.median(xs)  # noqa: E731
        for side, ref in (("ours", "dynamo"), ("ours", "base"), ("base", "dynamo")):
            o = [r for r in results if r.stack == side and r.mode == mode and r.processes == 1 and r.tracing == "off"]
            d = [r for r in results if r.stack == ref and r.mode == mode]
            if o and d:
                print(f"{mode} (medians of {len(o)} / {len(d)}): {side}/{ref} req/s "
                      f"{med([r.rps for r in o]) / med([r.rps for r in d]):.2f}, "
                      f"frontend CPU/req {med([r.frontend_ms_per_req for r in o]) / med([r.frontend_ms_per_req for r in d]):.2f}, "
                      f"stack CPU/req {med([r.stack_ms_per_req for r in o]) / med([r.stack_ms_per_req for r in d]):.2f}")
        ours_n = sorted({r.processes for r in results if r.stack == "ours" and r.mode == mode})
        one = [r for r in results if r.stack == "ours" and r.mode == mode and r.processes == 1 and r.tracing == "off"]
        for tr in tracings:
            on = [r for r in results if r.stack == "ours" and r.mode == mode and r.processes == 1 and r.tracing == tr]
            if tr != "off" and one and on:
                print(f"{mode}, ours with tracing at {tr} vs off (medians of {len(on)} / {len(one)}): "
                      f"req/s {med([r.rps for r in on]) / med([r.rps for r in one]):.2f}, "
                      f"frontend CPU/req {med([r.frontend_ms_per_req for r in on]) / med([r.frontend_ms_per_req for r in one]):.2f}, "
                      f"stack CPU/req {med([r.stack_ms_per_req for r in on]) / med([r.stack_ms_per_req for r in one]):.2f}, "
                      f"spans/req {med([r.spans / max(r.requests, 1) for r in on]):.2f}")
        for n in ours_n:
            many = [r for r in results if r.stack == "ours" and r.mode == mode and r.processes == n
                    and r.tracing == "off"]
            dyn = [r for r in results if r.stack == "dynamo" and r.mode == mode]
            parts = []
            if one and n != 1:
                parts.append(f"vs 1 process: req/s {med([r.rps for r in many]) / med([r.rps for r in one]):.2f}, "
                             f"stack CPU/req {med([r.stack_ms_per_req for r in many]) / med([r.stack_ms_per_req for r in one]):.2f}, "
                             f"frontend CPU/req {med([r.frontend_ms_per_req for r in many]) / med([r.frontend_ms_per_req for r in one]):.2f}")
            if dyn:
                parts.append(f"vs dynamo: req/s {med([r.rps for r in many]) / med([r.rps for r in dyn]):.2f}, "
                             f"stack CPU/req {med([r.stack_ms_per_req for r in many]) / med([r.stack_ms_per_req for r in dyn]):.2f}")
            if parts:
                print(f"{mode}, ours with {n} frontend process(es) (medians of {len(many)}): " + "; ".join(parts))
    for r in results:
        if r.profile_table:
            print("\n" + r.profile_table)
    if a.json:
        a.json.write_text(json.dumps([dict(asdict(r), frontend_ms_per_req=r.frontend_ms_per_req,
                                           stack_ms_per_req=r.stack_ms_per_req) for r in results],
                                     indent=1))


if __name__ == "__main__":
    main()
