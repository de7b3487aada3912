"""Shared vLLM-engine fixtures: engines take 15-60 s to start, so tests share them per module."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio

# pytest runs with --import-mode=importlib (test dirs are not on sys.path): make the shared
# helpers importable as `vllm_helpers` for this directory's test modules, which load after us.
sys.path.insert(0, str(Path(__file__).parent))
from vllm_helpers import TEST_ENGINE_ARGS, cpu_bind  # noqa: E402


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agg_engine() -> AsyncIterator[Any]:
    """One aggregated engine with LoRA and prompt embeddings on, shared by a test module."""
    from actors.engines.vllm_engine import VllmEngine

    engine = VllmEngine({**TEST_ENGINE_ARGS, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                         "max_cpu_loras": 4, "enable_prompt_embeds": True},
                        served_model_name="tiny", env={"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(0)})
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()
