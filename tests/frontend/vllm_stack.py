"""One vLLM-CPU engine actor behind a frontend on a real bus: what the frontend's vLLM test modules
share (each starts one per module; an engine takes ~20-30 s to start on CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from openai import AsyncOpenAI

from actors.base import Actor
from actors.frontend.actor import FrontendActor
from actors.worker.engine_actor import EngineActor
from actors.worker.engine_factory import build_engine
from bus.context import BusContext, open_context
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.helpers import openai_client


@dataclass
class VllmStack:
    client: AsyncOpenAI
    worker: EngineActor
    frontend: FrontendActor


@contextlib.asynccontextmanager
async def vllm_stack(nats_url: str, *, pool: PoolConfig, model: ModelConfig, instance: str,
                     router: str = "round_robin",
                     beside: Callable[[BusContext, EngineActor], Awaitable[Actor]] | None = None,
                     ready: Callable[[FrontendActor], bool] = lambda fe: True) -> AsyncIterator[VllmStack]:
    """The engine actor ``instance`` of ``pool``; ``beside`` starts another actor of the worker's
    process (a KV publisher); the frontend is ready once it routes to the worker, ``ready`` says
    so, and its tokenizer is loaded."""
    ctx = await open_context(nats_url, namespace="fe" + secrets.token_hex(4), host="testhost",
                             name=f"frontend-{instance}-test")
    worker = EngineActor(ctx.child(), pool_name="agg", pool=pool, model=model, instance=instance,
                         engine_factory=lambda: build_engine(pool, model))
    await worker.start()
    other = await beside(ctx.child(), worker) if beside is not None else None
    fe = FrontendActor(ctx.child(), config=FrontendConfig(http="127.0.0.1:0", stall_timeout=30.0, router=router),
                       model_config=model)
    await fe.start()
    try:
        for _ in range(400):
            if fe.workers.ready_instances() and fe.workers.models and ready(fe):
                break
            await asyncio.sleep(0.05)
        await fe.app.pipeline.preprocessors.get(fe.workers.models[model.name])
        yield VllmStack(openai_client(f"http://127.0.0.1:{fe.port}", timeout=120), worker, fe)
    finally:
        await fe.stop(2.0)
        if other is not None:
            await other.stop(2.0)
        await worker.stop(20.0)
        await ctx.close()
