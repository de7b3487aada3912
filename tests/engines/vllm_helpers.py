"""Helpers for the vLLM engine tests (imported as `vllm_helpers`; the fixtures are in conftest)."""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any

import pytest

from actors.engines.protocol import Engine, EngineOutput, LoraRef, Prompt, SamplingOptions

# Fast, small engines: a 128 MiB KV cache, short context, CPU defaults from VllmEngine.
TEST_ENGINE_ARGS: dict[str, Any] = {
    "model": "tiny",
    "max_model_len": 1024,
    "dtype": "bfloat16",
    "kv_cache_memory_bytes": 128 << 20,
}


def have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


needs_vllm = pytest.mark.skipif(not have_vllm(), reason="vllm is not installed")


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_bind(i: int) -> str:
    """One core per engine, round robin over the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[i % len(cores)])


async def collect(engine: Engine, prompt: Prompt, sampling: SamplingOptions, request_id: str,
                  lora: LoraRef | None = None,
                  kv_transfer_params: dict[str, Any] | None = None) -> list[EngineOutput]:
    return [o async for o in engine.generate(prompt, sampling, request_id, lora=lora,
                                             kv_transfer_params=kv_transfer_params)]


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


