"""Registry records are believed only once their instance answers on the bus (real nats-server).

A bucket that outlives its writers (a SIGKILLed run restarted within the TTL, an external NATS)
holds records and model cards of instances that no longer exist. The frontend must never list a
model or route a request because of them, and purges such ghosts.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from actors.instances.contract import InstanceRecord, ModelCard
from bus.registry import Registry
from tests.frontend.conftest import MODEL
from tests.helpers import eventually


async def write_ghost(deploy: Any, instance: str) -> Registry:
    """What a SIGKILLed worker leaves behind: its card and its record, nobody behind them."""
    bus = deploy.bus
    cards = Registry(bus.js, bus.subjects.bucket_models)
    await cards.ensure()
    await cards.put(f"{MODEL}.agg", msgspec.json.encode(ModelCard(
        served_model_name=MODEL, pool="agg", role="agg", model_path=deploy.tiny_dir,
        tokenizer_path=deploy.tiny_dir, context_length=512, kv_block_size=32, total_kv_blocks=100)))
    instances = Registry(bus.js, bus.subjects.bucket_instances)
    await instances.ensure()
    await instances.put(instance, msgspec.json.encode(InstanceRecord(
        instance=instance, kind="engine", role="agg", model=MODEL, host="local", pid=999999, pool="agg",
        generate_subject=bus.subjects.generate_instance("agg", instance), started_at=1.0)))
    return instances


async def test_ghost_records_are_never_routed_to_and_are_purged(deploy: Any, http: aiohttp.ClientSession) -> None:
    instances = await write_ghost(deploy, "agg-0-dead00")
    fe = await deploy.start_frontend()
    await eventually(lambda: fe.workers.records(), 10)  # the watch has delivered the ghost
    assert fe.workers.ready_instances() == []
    async with http.get(deploy.url + "/v1/models") as r:
        assert (await r.json())["data"] == []
    async with http.post(deploy.url + "/v1/chat/completions",
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 503 and r.headers["Retry-After"]  # known model, not servable: not a 404
        assert "not ready" in (await r.json())["error"]["message"]
    async with http.get(deploy.url + "/health") as r:
        assert r.status == 503 and (await r.json())["instances"] == []

    # a live worker next to the ghost is confirmed and served; the ghost is purged from the bucket
    live = await deploy.worker()
    await eventually(lambda: [w.instance for w in fe.workers.ready_instances()] == [live.instance], 10)
    await eventually(lambda: fe.workers.record("agg-0-dead00") is None, 15)
    assert await instances.get("agg-0-dead00") is None
    async with http.post(deploy.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
        assert r.status == 200 and r.headers["x-worker-instance-id"] == live.instance


async def test_a_worker_that_vanishes_without_deregistering_is_dropped_before_its_ttl(
        deploy: Any, http: aiohttp.ClientSession) -> None:
    """SIGKILL leaves a record that lives until the bucket's TTL; the frontend stops routing to it
    and counting it ready as soon as it stops answering on the bus."""
    bus = deploy.bus
    live = await deploy.worker()
    fe = await deploy.start_frontend()
    fe._confirmer.recheck = 0.2
    await eventually(lambda: [w.instance for w in fe.workers.ready_instances()] == [live.instance], 10)
    # the process dies: its subscriptions vanish with its connection, its record stays behind
    await live._service.stop(0.0)
    await eventually(lambda: fe.workers.ready_instances() == [], 5)
    reg = Registry(bus.js, bus.subjects.bucket_instances)
    await reg.ensure()
    assert fe.workers.record(live.instance) is not None or await reg.get(live.instance) is not None
    async with http.get(deploy.url + "/health") as r:
        assert r.status == 503


async def test_settled_returns_once_the_first_probes_have_ended(deploy: Any) -> None:
    """What a frontend process waits for before it takes connections (frontend.processes > 1): once
    ``settled`` says so, a live worker's record is confirmed and a ghost's is not routed to."""
    live = await deploy.worker()
    await write_ghost(deploy, "agg-0-dead01")
    fe = await deploy.start_frontend()
    assert fe._confirmer is not None
    assert await fe._confirmer.settled(5.0)
    assert [w.instance for w in fe.workers.ready_instances()] == [live.instance]
