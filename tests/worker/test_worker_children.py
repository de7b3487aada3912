"""The whole worker (run_worker, mocker engine) with its engine dependants: KV publisher and LoRA
manager, talking only over NATS; LoRA re-applied after an engine restart. (Checkpoint mode:
test_checkpoint.py.)"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import msgspec
import pytest

from actors.engines.protocol import SamplingOptions
from actors.kv import hashing
from actors.kv.contract import decode_events
from actors.worker import contract as C
from actors.worker.contract import GenerateChunk, GenerateRequest
from actors.worker.process import run_worker
from bus import rpc
from bus.context import open_context
from bus.errors import BadRequest, NotFound
from bus.registry import Registry
from bus.stream import stream_request
from config.loader import load_topology
from tests.worker.test_worker_process import write_topology

FAST_RESTART = '[pools.agg.supervisor]\nstrategy = "rest_for_one"\nbackoff = { initial = 0.05, max = 0.2 }\n'


def write(tmp: Path, url: str, ns: str, extra: str = "", args: str = "") -> Path:
    return write_topology(tmp, url, ns, extra=f"{FAST_RESTART}{extra}", args=args)


async def engine_instance(ctx, timeout: float = 15.0) -> str:
    reg = Registry(ctx.js, ctx.subjects.bucket_instances)
    await reg.ensure()
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        for key, raw in (await reg.items()).items():
            if json.loads(raw).get("kind") == "engine":
                return key
        await asyncio.sleep(0.05)
    raise AssertionError("no engine instance registered")


async def generate(ctx, instance: str, tokens: list[int], lora: str | None = None, n: int = 8) -> list[int]:
    req = GenerateRequest(token_ids=tokens, sampling=SamplingOptions(max_tokens=n, ignore_eos=True),
                          lora_name=lora)
    out: list[int] = []
    async for chunk in stream_request(ctx.nc, ctx.subjects.generate_instance("agg", instance), req,
                                      chunk_type=GenerateChunk, stall_timeout=5.0):
        out += chunk.token_ids
    return out


async def test_lora_and_kv_publisher_through_restart(nats_server, tmp_path: Path, adapter_root: Path) -> None:
    ns = f"w{secrets.token_hex(3)}"
    topo = write(tmp_path, nats_server.url, ns, extra=f'[pools.agg.lora]\nroots = ["{adapter_root}"]',
                 args="enable_lora = true\nmax_loras = 2\ndie_after_tokens = 60")
    t = load_topology(topo)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(t, "agg", 0, stop=stop))
    ctx = await open_context(nats_server.url, ns, "local", "test")
    try:
        inst = await engine_instance(ctx)
        events: list = []

        async def on_event(m) -> None:
            events.extend(decode_events(m.data, m.headers))

        sub = await ctx.nc.subscribe(ctx.subjects.kv_events(inst), cb=on_event)
        await asyncio.sleep(0.3)  # the lazily built KV publisher asks the engine for its sources
        prompt = list(range(100, 148))  # 3 full blocks of 16
        base = await generate(ctx, inst, prompt)

        # LoRA: load over NATS (plain JSON, as `nats req` sends), generate with it, output differs.
        uri = f"file://{adapter_root}/a1"
        reply = await rpc.request(ctx.nc, ctx.subjects.worker(inst, "lora.load"),
                                  {"lora_name": "a1", "source": {"uri": uri}}, timeout=10)
        assert reply["status"] == "ok" and reply["instance"] == inst
        assert await generate(ctx, inst, prompt, lora="a1") != base
        loras = Registry(ctx.js, ctx.subjects.bucket_loras)
        await loras.ensure()
        rec = msgspec.json.decode((await loras.get(f"{inst}.a1")) or b"null", type=C.LoraRecord)
        assert rec.instance == inst and rec.uri == uri
        with pytest.raises(NotFound):
            await generate(ctx, inst, prompt, lora="never-loaded")
        # bad adapter requests get typed errors and the manager keeps serving
        for bad, err in ((f"file://{adapter_root}/../a1", BadRequest), ("file:///etc", BadRequest),
                         ("ftp://x/y", BadRequest), (f"file://{adapter_root}/missing", NotFound)):
            with pytest.raises(err):
                await rpc.request(ctx.nc, ctx.subjects.worker(inst, "lora.load"),
                                  {"lora_name": "bad", "source": {"uri": bad}}, timeout=10)
        with pytest.raises(BadRequest):  # malformed request: no source
            await rpc.request(ctx.nc, ctx.subjects.worker(inst, "lora.load"), {"lora_name": "x"}, timeout=10)
        listed = await rpc.request(ctx.nc, ctx.subjects.worker(inst, "lora.list"), {}, timeout=10)
        assert [a["lora_name"] for a in listed["adapters"]] == ["a1"]

        # KV events for the base prompt carry the router hashes of its tokens.
        for _ in range(50):
            if any(e.kind == "stored" for e in events):
                break
            await asyncio.sleep(0.05)
        stored = [b.seq_hash for e in events if e.kind == "stored" and e.lora_name is None for b in e.stored]
        assert stored[:3] == hashing.sequence_hashes(prompt, 16)
        await sub.unsubscribe()

        # The engine dies (fault injection after 60 tokens); rest_for_one restarts it and the LoRA
        # manager after it, which re-applies the adapter from ns-loras.
        reg = Registry(ctx.js, ctx.subjects.bucket_instances)
        await reg.ensure()
        first_start = json.loads(await reg.get(inst) or b"{}")["started_at"]
        with pytest.raises(Exception):  # noqa: B017 - the stream ends with a typed transport/engine error
            for _ in range(10):
                await generate(ctx, inst, prompt, n=16)
        for _ in range(200):  # a new incarnation registers (the dying one still answers for ~2 s)
            raw = await reg.get(inst)
            if raw and json.loads(raw)["started_at"] != first_start:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the engine was not restarted")
        for _ in range(200):
            try:
                listed = await rpc.request(ctx.nc, ctx.subjects.worker(inst, C.ENGINE_LORA_LIST), {}, timeout=1,
                                           reply_type=C.EngineLoraList)
                if [a.lora_name for a in listed.adapters] == ["a1"]:
                    break
            except Exception:  # noqa: BLE001 - restarting
                pass
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("adapter not re-applied after the engine restart")
        assert await generate(ctx, inst, prompt, lora="a1", n=4)
    finally:
        stop.set()
        assert await asyncio.wait_for(worker, 30) == 0
        await ctx.close()
