"""The dashboard against a real Prometheus: a deployment started with the CLI (mocker engines,
disaggregated, a no-op planner, the root's metrics port and the workers' status ports set), the
scrape configuration rendered by the CLI, Prometheus started on it, OpenAI traffic (a 4xx among
it), a worker process SIGKILLed and restarted by its supervisor; then every PromQL expression of
deploy/observability/grafana-dashboard.json must return data, and every metric it names must exist.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
from typing import Any

import nats
import openai
import pytest

from tests.e2e.conftest import PY, ROOT, Deployment, free_port, http_json, http_text, shutdown
from tests.helpers import openai_client

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = ROOT / "deploy" / "observability" / "grafana-dashboard.json"
# what Grafana would put for the dashboard's variables: every model and pool, and a 30 s window
GRAFANA_VARS = {"$__rate_interval": "30s", "$__interval": "30s", "$model": ".*", "$pool": ".*"}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None,
                                 reason="prometheus not installed (make test installs it: apt-get install prometheus)")]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables replaced) of every target of every panel."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: a variable the test does not replace: {expr}"
            out.append((panel["title"], expr))
    return out


def api(base: str, path: str, **params: str) -> Any:
    status, body = http_json(f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else ""))
    assert status == 200 and body["status"] == "success", (path, params, body)
    return body["data"]


async def root_children(d: Deployment) -> list[dict[str, Any]]:
    nc = await nats.connect(d.bus_url)
    try:
        msg = await nc.request(f"{d.namespace}.supervisor.local.children", b"{}", timeout=10)
        return json.loads(msg.data)["children"]
    finally:
        await nc.close()


async def traffic(d: Deployment, n: int) -> None:
    """``n`` chat and ``n`` completions requests, half of them streamed, and one request that gets a 404."""
    client = openai_client(d.url)

    async def chat(i: int) -> None:
        messages = [{"role": "user", "content": f"tell me about metrics {i % 3}"}]
        if i % 2:
            stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True)
            assert [c async for c in stream]
        else:
            r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
            assert r.choices[0].message.content is not None

    async def completion(i: int) -> None:
        if i % 2:
            stream = await client.completions.create(model="tiny", prompt=f"metrics {i}", max_tokens=8, stream=True)
            assert [c async for c in stream]
        else:
            r = await client.completions.create(model="tiny", prompt=f"metrics {i}", max_tokens=8)
            assert r.choices[0].text is not None

    try:
        await asyncio.gather(*(chat(i) for i in range(n)), *(completion(i) for i in range(n)))
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    finally:
        await client.close()


async def test_every_dashboard_query_returns_data(tmp_path_factory: pytest.TempPathFactory) -> None:
    assert PROMETHEUS is not None
    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("prometheus")
    root_port = free_port()
    d = Deployment("mocker-disagg.toml", tmp, namespace=f"e2eprom{time.monotonic_ns() % 10**9}",
                   status_pools={"prefill": 1, "decode": 2},
                   sets=["planner.enabled=true", "planner.mode=load", "planner.no_op=true", "planner.interval=2",
                         f"metrics.root_port={root_port}"])
    d.start()
    prom: subprocess.Popen[bytes] | None = None
    try:
        d.wait_ready({"prefill": 1, "decode": 2}, timeout=60)
        config = tmp / "prometheus.yml"
        subprocess.run([PY, "-m", "actors.supervisor", d.topology, *d.args, "--emit-prometheus", str(config),
                        "--scrape-interval", "1s"], cwd=ROOT, check=True, capture_output=True, timeout=60)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with open(tmp / "prometheus.log", "wb") as log:
            prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def prometheus_ready() -> bool:
            # Prometheus answers its API with 503 until its TSDB is open (longer on a loaded box);
            # /-/ready turns 200 at that moment. Its 503 raises HTTPError, an OSError: wait_until polls again
            return http_text(f"{base}/-/ready", timeout=2).startswith("Prometheus")

        d.wait_until(prometheus_ready, 60, f"Prometheus ready (its log: {tmp / 'prometheus.log'})")

        def targets_up() -> bool:
            active = api(base, "targets")["activeTargets"]
            # the frontend (one target), three workers' status ports, the root
            return len(active) == 5 and all(t["health"] == "up" for t in active)

        d.wait_until(targets_up, 30, "every scrape target up")
        await traffic(d, 12)

        # a worker process SIGKILLed: its root restarts it (reason "signal SIGKILL")
        victim = next(c for c in await root_children(d) if (c.get("meta") or {}).get("pool") == "decode")
        os.kill(victim["pid"], signal.SIGKILL)

        async def restarted() -> bool:
            c = next(c for c in await root_children(d) if c["id"] == victim["id"])
            return c["state"] == "running" and c["pid"] != victim["pid"]

        end = time.monotonic() + 30
        while not await restarted():
            assert time.monotonic() < end, f"{victim['id']} not restarted:\n{d.output(3000)}"
            await asyncio.sleep(0.25)
        d.wait_ready({"prefill": 1, "decode": 2}, timeout=30)
        await traffic(d, 6)

        exprs = dashboard_exprs()
        empty: list[str] = []
        end = time.monotonic() + 30
        while True:  # rates need two samples of a series inside their window: a few scrapes
            empty = [f"{title}: {expr}" for title, expr in exprs
                     if not api(base, "query", query=expr)["result"]]
            if not empty or time.monotonic() > end:
                break
            await asyncio.sleep(1)
        names = set(api(base, "label/__name__/values"))
        missing = sorted({n for _, expr in exprs for n in re.findall(r"\bvllm_actors_\w+", expr)} - names)
        assert not missing, f"the dashboard names metrics no target exports: {missing}"
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

        assert api(base, "query", query='vllm_actors_supervisor_restarts_total{reason="signal SIGKILL", '
                                        f'child="{victim["id"]}"}} >= 1')["result"]
        # disaggregated: the tokens come from the decode pool, which is what latency is labelled with
        ttft = api(base, "query", query="vllm_actors_frontend_time_to_first_token_seconds_count")["result"]
        assert {r["metric"]["pool"] for r in ttft} == {"decode"}, ttft
        # the workers' own label is worker_id: no scrape renamed it to exported_instance
        assert api(base, "query", query="count(vllm_actors_worker_requests_total)")["result"]
        assert not api(base, "query", query='{__name__=~"vllm_actors_.+", exported_instance!=""}')["result"]
        print(f"prometheus e2e: {time.monotonic() - t0:.1f} s")
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(10)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        shutdown(d)


def test_dashboard_is_importable() -> None:
    """Grafana's import needs these: a schema version, the datasource input, the variables."""
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["schemaVersion"], int)
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"model", "pool"}
    assert all(v["definition"].startswith("label_values(") for v in variables.values())
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]

