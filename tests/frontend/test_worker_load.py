"""The frontend's view of every worker's load on its /metrics (a real frontend with the default
round-robin router, a scripted worker, load reports published on the real bus)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from actors.worker.contract import LoadReport
from bus import codec


async def scrape(deploy: Any, http: Any) -> str:
    async with http.get(deploy.url + "/metrics") as r:
        return await r.text()


async def until_match(deploy: Any, http: Any, pattern: str, present: bool = True) -> str:
    for _ in range(100):
        text = await scrape(deploy, http)
        if bool(re.search(pattern, text, re.M)) == present:
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(f"{pattern!r} {'never appeared' if present else 'never went away'}:\n{text}")


async def test_worker_load_by_worker_pool_model_and_rank(deploy: Any, http: Any) -> None:
    fe = await deploy.start_frontend()
    assert fe.config.router != "kv"  # the frontend subscribes itself: no KV router feeds it here
    w = await deploy.worker(pool="agg")
    await deploy.wait_ready(1)
    nc = deploy.bus.nc
    for rank, (waiting, usage) in enumerate([(3, 0.25), (0, 0.5)]):
        report = LoadReport(instance=w.instance, dp_rank=rank, num_running=2, num_waiting=waiting, kv_usage=usage,
                            active_kv_blocks=8, total_kv_blocks=32, prefix_hit_rate=0.75)
        await nc.publish(deploy.bus.subjects.load(w.instance), codec.encode(report), headers=codec.headers_for(False))
    labels = f'dp_rank="1",model="tiny",pool="agg",worker_id="{w.instance}"'
    text = await until_match(deploy, http, rf"^vllm_actors_frontend_worker_kv_usage_perc\{{{labels}\}} 0\.5$")
    labels0 = f'dp_rank="0",model="tiny",pool="agg",worker_id="{w.instance}"'
    assert f"vllm_actors_frontend_worker_num_requests_waiting{{{labels0}}} 3.0" in text
    assert f"vllm_actors_frontend_worker_num_requests_running{{{labels0}}} 2.0" in text
    assert f"vllm_actors_frontend_worker_prefix_cache_hit_rate{{{labels0}}} 0.75" in text
    assert f"vllm_actors_frontend_worker_kv_total_blocks{{{labels0}}} 32.0" in text
    # a report of an instance the registry does not know is no series
    stray = LoadReport(instance="ghost", num_running=1, num_waiting=1, kv_usage=0.1, active_kv_blocks=1,
                       total_kv_blocks=2)
    await nc.publish(deploy.bus.subjects.load("ghost"), codec.encode(stray), headers=codec.headers_for(False))
    await nc.flush()
    await asyncio.sleep(0.1)
    assert 'worker_id="ghost"' not in await scrape(deploy, http)
    await w.stop(1.0)  # deregistered: its series go with its record
    await until_match(deploy, http, rf'worker_id="{w.instance}"', present=False)
