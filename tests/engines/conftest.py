"""Shared vLLM-engine fixtures: engines take 15-60 s to start, so tests share them.

``agg_engine`` is one engine for every test module of this directory that asks for it (the wire
identity and the engine tests), on pytest-asyncio's session loop: such a module marks its tests
``pytest.mark.asyncio(loop_scope="session")``. It is shut down after the last test that uses it, so
it does not outlive this directory's tests. A test that kills it (the engine-death test) leaves a
dead engine, and the next test that asks gets a new one; any other change a test makes to it (a
LoRA loaded, the identity adapter switched off) the test undoes.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

# pytest runs with --import-mode=importlib (test dirs are not on sys.path): make the shared
# helpers importable as `vllm_helpers` for this directory's test modules, which load after us.
sys.path.insert(0, str(Path(__file__).parent))
from vllm_helpers import TEST_ENGINE_ARGS, cpu_bind  # noqa: E402

from tests.sharing import last_user  # noqa: E402


class SharedEngine:
    """The aggregated engine with LoRA and prompt embeddings on, started on first use."""

    def __init__(self) -> None:
        self.engine: Any = None  # actors.engines.vllm_engine.VllmEngine (vLLM is imported lazily)

    async def get(self) -> Any:
        if self.engine is not None and self.engine.dead.is_set():
            await self.close()  # killed by a test: the next one gets a live engine
        if self.engine is None:
            from actors.engines.vllm_engine import VllmEngine

            engine = VllmEngine({**TEST_ENGINE_ARGS, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                                 "max_cpu_loras": 4, "enable_prompt_embeds": True},
                                served_model_name="tiny", env={"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(0)})
            await engine.start()
            self.engine = engine
        return self.engine

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.shutdown()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def shared_agg_engine() -> AsyncIterator[SharedEngine]:
    shared = SharedEngine()
    try:
        yield shared
    finally:
        await shared.close()


@pytest_asyncio.fixture(loop_scope="session")
async def agg_engine(shared_agg_engine: SharedEngine, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The shared engine (see the module docstring). After the session's last test that uses it it
    is shut down, when that test asked for it by this fixture (else at the session's end)."""
    yield await shared_agg_engine.get()
    if request.node is last_user(request.session.items, "shared_agg_engine"):
        await shared_agg_engine.close()
