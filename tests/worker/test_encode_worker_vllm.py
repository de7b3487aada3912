"""E/P/D on vLLM-CPU with the tiny Idefics3: an encode worker and an agg worker, each started as the
worker process a deployment starts (``python -m actors.worker.process``) from one topology, on a
real nats-server.

The encode worker answers ``worker.<id>.encode`` with the safetensors files of vLLM's EC connector,
and the agg worker (an ``ec_consumer``, because the topology has an encode pool) loads the outputs a
request carries instead of running its own encoder. Greedy output with transferred outputs equals
the agg worker's own; with another image's output in place of an image's, it equals that other
image's answer, which proves the engine used what it was given. Two engines in this module (~30 s
each to start on CPU, started at once).
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from actors.engines.protocol import ImageInput, MultiModalInput, SamplingOptions
from actors.instances.contract import WORKER_KIND
from actors.worker import contract as C
from actors.worker.contract import EncodeReply, EncodeRequest, GenerateChunk, GenerateRequest, LivenessReply
from bus import rpc
from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats
from bus.errors import BadRequest, Unavailable
from bus.stream import stream_request
from tests.helpers import registry

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "<|begin_of_text|><|im_start|>user\n{images}What is this?<|im_end|>\n<|im_start|>assistant\n"
ENGINE_ARGS = 'max_model_len = 1024\ndtype = "bfloat16"\nkv_cache_memory_bytes = 67108864\n'
START_TIMEOUT = 300.0


def png(seed: int, w: int = 64, h: int = 48) -> bytes:
    """Random noise: seeds 1 and 2 give different greedy answers from the tiny VLM."""
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


class Expander:
    """What the frontend does to an image prompt: vLLM's processor expands each image placeholder."""

    def __init__(self, model_path: str) -> None:
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        self.proc = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=model_path, max_model_len=1024))
        self.tok = self.proc.info.get_tokenizer()

    def prompt(self, images: list[tuple[str, bytes]]) -> tuple[list[int], MultiModalInput]:
        """(expanded ids, mm) of a prompt with ``images`` as (uuid, data): any 64-hex uuid will do
        for a worker (it cannot check that an id is its data's sha256), so a test names each image
        afresh to keep the workers' caches out of its comparisons."""
        from vllm.multimodal.processing.context import TimingContext
        from vllm.multimodal.processing.inputs import ProcessorInputs

        source = self.tok.encode(PROMPT.format(images="<image>" * len(images)), add_special_tokens=False)
        items = self.proc.info.parse_mm_data({"image": [Image.open(io.BytesIO(d)) for _, d in images]})
        out: Any = self.proc.apply(ProcessorInputs(prompt=source, mm_data_items=items,
                                                   mm_uuid_items={"image": [u for u, _ in images]}),
                                   TimingContext(enabled=False))
        ids = list(out["prompt_token_ids"])
        return ids, MultiModalInput(images=[ImageInput(uuid=u, data=d) for u, d in images], source_ids=source,
                                    prompt_len=len(ids),
                                    placeholders=[(r.offset, r.length) for r in out["mm_placeholders"]["image"]])


def fresh() -> str:
    return secrets.token_hex(32)


class Env:
    def __init__(self, ctx: BusContext, instances: dict[str, str], expander: Expander) -> None:
        self.ctx, self.instances, self.x = ctx, instances, expander

    async def encode(self, ids: list[int], mm: MultiModalInput, instance: str | None = None) -> dict[str, bytes]:
        subject = self.ctx.subjects.worker(instance or self.instances["enc"], C.VERB_ENCODE)
        reply = await rpc.request(self.ctx.nc, subject, EncodeRequest(request_id=fresh(), token_ids=ids, mm=mm),
                                  timeout=30, msgpack=True, reply_type=EncodeReply)
        return {o.uuid: o.encoder_output for o in reply.outputs}

    async def generate(self, ids: list[int], mm: MultiModalInput, outputs: dict[str, bytes] | None = None,
                       pool: str = "agg") -> list[int]:
        if outputs is not None:
            mm = msgspec.structs.replace(mm, images=[msgspec.structs.replace(img, encoder_output=outputs.get(img.uuid))
                                                     for img in mm.images])
        req = GenerateRequest(token_ids=ids, mm=mm, sampling=SamplingOptions(max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True))
        subject = self.ctx.subjects.generate_instance(pool, self.instances[pool])
        chunks = [c async for c in stream_request(self.ctx.nc, subject, req, chunk_type=GenerateChunk,
                                                  stall_timeout=30)]
        assert chunks[-1].finish_reason == "length"
        return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def workers(nats_server: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from actors.models.tiny_vlm import ensure_tiny_vlm

    ensure_tiny_vlm()
    tmp = tmp_path_factory.mktemp("epd")
    ns = "e" + secrets.token_hex(4)
    topology = tmp / "epd.toml"
    topology.write_text(f"""
namespace = "{ns}"
[bus]
url = "{nats_server.url}"
[model]
name = "vlm"
path = "tiny-vlm"
[frontend]
enabled = false
[pools.enc]
role = "encode"
[pools.enc.engine_args]
{ENGINE_ARGS}
[pools.agg]
role = "agg"
[pools.agg.engine_args]
{ENGINE_ARGS}
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    for pool in ("enc", "agg"):
        log = tmp / f"{pool}.log"
        with open(log, "wb") as f:
            procs.append((subprocess.Popen([sys.executable, "-m", "actors.worker.process", "--topology", str(topology),
                                            "--pool", pool], env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT),
                          log))
    try:
        yield ns, tmp
    finally:
        for p, _ in procs:
            p.terminate()
        for p, log in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode not in (0, -15):
                print(f"--- {log.name} (rc={p.returncode}) ---\n{log.read_text()[-4000:]}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(workers: tuple[str, Path], nats_server: EmbeddedNats) -> AsyncIterator[Env]:
    ns, tmp = workers
    ctx = await open_context(nats_server.url, namespace=ns, host="testhost", name="epd-test")
    expander = await asyncio.to_thread(Expander, str(Path.home() / ".cache/vllm-actors/models/tiny-vlm"))
    deadline = time.monotonic() + START_TIMEOUT
    instances: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            recs = await registry(ctx.nc, ns)
        except nats.js.errors.BucketNotFoundError:  # no worker has registered yet
            recs = {}
        instances = {r["pool"]: r["instance"] for r in recs.values()
                     if r.get("kind") == WORKER_KIND and r.get("status", "ready") == "ready"}
        if len(instances) == 2:
            break
        await asyncio.sleep(1.0)
    else:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))
        raise AssertionError(f"workers not registered within {START_TIMEOUT}s: {instances}\n{logs}")
    try:
        yield Env(ctx, instances, expander)
    finally:
        await ctx.close()


async def test_the_encode_worker_registers_as_encode(env: Env) -> None:
    """Registered only after its readiness probe (its built-in image encoded through its own encode
    subject); role "encode" in its record and its model card, as the frontend finds it."""
    recs = {r["pool"]: r for r in (await registry(env.ctx.nc, env.ctx.namespace)).values() if r.get("kind") == WORKER_KIND}
    assert recs["enc"]["role"] == "encode" and recs["agg"]["role"] == "agg"
    kv = await env.ctx.js.key_value(env.ctx.subjects.bucket_models)
    card = msgspec.json.decode((await kv.get("vlm.enc")).value)
    assert card["role"] == "encode" and card["input_modalities"] == ["text", "image"]


async def test_transferred_outputs_give_the_agg_answer_and_another_images_output_changes_it(env: Env) -> None:
    d1, d2 = png(1), png(2)
    ids, mm1 = env.x.prompt([(fresh(), d1)])
    ids2, mm2 = env.x.prompt([(fresh(), d2)])
    assert ids2 == ids  # same size, same expansion: only the pictures differ
    out1, out2 = await env.encode(ids, mm1), await env.encode(ids, mm2)
    (u1, e1), (u2, e2) = *out1.items(), *out2.items()
    assert (u1, u2) == (mm1.images[0].uuid, mm2.images[0].uuid) and e1 != e2
    assert e1[8:].startswith(b'{"ec_cache":{"dtype":"BF16","shape":[20,128]')  # vLLM's EC file
    # the agg worker's own encoder (fresh ids: nothing cached under them)
    ref1 = await env.generate(*env.x.prompt([(fresh(), d1)]))
    ref2 = await env.generate(*env.x.prompt([(fresh(), d2)]))
    assert ref1 != ref2
    assert await env.generate(ids, mm1, out1) == ref1
    assert await env.generate(ids, mm2, out2) == ref2
    # picture 1 with picture 2's encoder output: the engine answers about picture 2
    _, mm_swapped = env.x.prompt([(fresh(), d1)])
    assert await env.generate(ids, mm_swapped, {mm_swapped.images[0].uuid: e2}) == ref2
    # the same image again: the encode worker's own cache answers, with the same output
    assert await env.encode(ids, mm1) == out1


async def test_a_prompt_of_two_images(env: Env) -> None:
    """One output per distinct image, in prompt order; an image repeated in a prompt once."""
    a, b = (fresh(), png(3)), (fresh(), png(4))
    ids, mm = env.x.prompt([a, b, a])
    outputs = await env.encode(ids, mm)
    assert list(outputs) == [a[0], b[0]]
    ref = await env.generate(*env.x.prompt([(fresh(), a[1]), (fresh(), b[1]), (fresh(), a[1])]))
    assert await env.generate(ids, mm, outputs) == ref
    # only some images with an output: the engine encodes the others itself
    ids, mm = env.x.prompt([(fresh(), a[1]), (fresh(), b[1]), (fresh(), a[1])])
    assert await env.generate(ids, mm, {mm.images[1].uuid: outputs[b[0]]}) == ref


async def test_refusals(env: Env) -> None:
    ids, mm = env.x.prompt([(fresh(), png(1))])
    with pytest.raises(BadRequest, match="this is an encode worker"):
        await env.generate(ids, mm, pool="enc")
    bad = msgspec.structs.replace(mm, images=[msgspec.structs.replace(mm.images[0], uuid="../" + "a" * 61)])
    with pytest.raises(BadRequest, match="sha256 hex"):
        await env.encode(ids, bad)
    with pytest.raises(BadRequest, match="placeholder"):
        await env.encode(ids, msgspec.structs.replace(mm, placeholders=[(40, 33)]))
    with pytest.raises(Unavailable, match="no responders"):  # an agg worker serves no encode verb
        await env.encode(ids, mm, instance=env.instances["agg"])
    # an output the consumer's engine cannot load is refused before it reaches the engine ...
    good = (await env.encode(ids, mm))[mm.images[0].uuid]
    for broken, why in ((b"garbage", "too short"), (good[:-4], "does not match its header"),
                        (good.replace(b'"BF16"', b'"F16" '), "is BF16, not 'F16'")):
        _, mm_b = env.x.prompt([(fresh(), png(1))])
        with pytest.raises(BadRequest, match=why):
            await env.generate(ids, mm_b, {mm_b.images[0].uuid: broken})
    # ... and the engine serves on
    ref = await env.generate(*env.x.prompt([(fresh(), png(1))]))
    assert await env.generate(ids, mm, {mm.images[0].uuid: good}) == ref


async def test_the_health_monitor_probes_the_encoder(env: Env) -> None:
    """An encode worker's liveness probe encodes its built-in image (a generate would be refused)."""
    subject = env.ctx.subjects.worker(env.instances["enc"], C.VERB_LIVENESS)
    for _ in range(100):
        reply = await rpc.request(env.ctx.nc, subject, {}, timeout=5, reply_type=LivenessReply)
        if reply.status == "ok":
            break
        await asyncio.sleep(0.2)
    assert reply.status == "ok" and reply.failures == 0, reply
    probe = EncodeRequest(request_id=fresh(), token_ids=[], probe=True,
                          mm=MultiModalInput(images=[], source_ids=[], prompt_len=0, placeholders=[]))
    reply2 = await rpc.request(env.ctx.nc, env.ctx.subjects.worker(env.instances["enc"], C.VERB_ENCODE), probe,
                               timeout=30, reply_type=EncodeReply)  # JSON works as well as msgpack
    assert reply2.outputs == []
