"""Test scaffolding for the frontend: a small scripted worker on the real bus (NOT the engine actor).

``ScriptedWorker`` is an honest stand-in until the engine actor is used in these tests: an
``actors.base.Actor`` serving ``GenerateChunk`` streams on its routed generate subject, registered in
ns-instances (InstanceRecord) with its ModelCard in ns-models. Its output is deterministic: the
token at sequence position p is ``TEXT_IDS[p % len(TEXT_IDS)]``, so a request re-sent with the produced
tokens appended continues exactly where the first worker stopped (what migration relies on).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import aiohttp
import pytest

from actors.base import Actor, Endpoint
from actors.engines.protocol import TokenLogprob
from actors.frontend.actor import FrontendActor
from actors.frontend.preprocess import SHARED
from actors.instances.contract import ModelCard
from actors.models.tiny import ensure_tiny_model
from actors.worker.contract import DisaggregatedParams, GenerateChunk, GenerateRequest, Usage
from bus.context import BusContext
from bus.registry import Registry
from config.topology import FrontendConfig, ModelConfig

MODEL = "tiny"
CONTEXT = 1024
TEXT = " one two three four five six seven eight nine ten eleven twelve"


class ScriptedWorker(Actor):
    kind: ClassVar[str] = "engine"
    description: ClassVar[str] = "test scaffolding: scripted generate worker"

    def __init__(self, bus: BusContext, *, tokenizer_path: str, text_ids: list[int], pool: str = "agg",
                 role: str = "agg", model: str = MODEL, delay: float = 0.0, die_after: int | None = None,
                 cached_tokens: int = 0, card_tokenizer: str | None = None, drop_after: int | None = None,
                 **kw: Any) -> None:
        super().__init__(bus, role=role, model=model, **kw)
        self.pool = pool
        self.tokenizer_path = tokenizer_path
        self.text_ids = text_ids
        self.delay = delay
        self.die_after = die_after
        self.drop_after = drop_after  # end the first stream after this many tokens, staying alive
        self.cached = cached_tokens
        self.card_tokenizer = card_tokenizer
        self.requests: list[GenerateRequest] = []
        self.cancelled: list[str] = []
        self.cancelled_at: list[float] = []  # time.monotonic() of each cancel (for latency reports)
        self.completed: list[str] = []
        self._cards: Registry | None = None

    @property
    def subject(self) -> str:
        return self.bus.subjects.generate_instance(self.pool, self.instance)

    def endpoints(self) -> list[Endpoint]:
        # stats: the worker verb a frontend asks to confirm a registry record is a live instance
        return [Endpoint("generate", self.subject, self.generate, request_type=GenerateRequest,
                         streaming=True, queue_group=None),
                Endpoint("stats", self.bus.subjects.worker(self.instance, "stats"), self._stats,
                         queue_group=None, bounded=False)]

    async def _stats(self, req: Any, headers: Any) -> dict[str, Any]:
        return self._stats_data()

    def record(self) -> dict[str, Any]:
        rec = dict(super().record())  # type: ignore[arg-type]
        rec.update(pool=self.pool, generate_subject=self.subject, block_size=32)
        return rec

    async def on_start(self) -> None:
        self._cards = Registry(self.bus.js, self.bus.subjects.bucket_models, self.registry_ttl)
        await self._cards.ensure()
        card = ModelCard(served_model_name=self.model, pool=self.pool, role=self.role,
                         model_path=self.tokenizer_path,
                         tokenizer_path=self.card_tokenizer if self.card_tokenizer is not None
                         else self.tokenizer_path,
                         context_length=CONTEXT, kv_block_size=32, total_kv_blocks=1000)
        await self._cards.register(f"{self.model}.{self.pool}", card)

    async def on_stop(self) -> None:
        if self._cards is not None:
            await self._cards.close()

    async def generate(self, req: GenerateRequest, headers: Any) -> AsyncIterator[GenerateChunk]:
        self.requests.append(req)
        ids = list(req.token_ids or [])
        so = req.sampling
        n = 1 if self.role == "prefill" else so.max_tokens
        try:
            for i in range(n):
                if self.die_after is not None and i >= self.die_after:
                    # the process "dies": the service goes away without ending the stream
                    self.fail(RuntimeError("scripted death"))
                    await asyncio.sleep(3600)
                if self.drop_after is not None and i >= self.drop_after:
                    # the stream is lost, the worker is not (what a bus restart does to a stream)
                    self.drop_after = None
                    return
                tok = self.text_ids[len(ids) % len(self.text_ids)]
                ids.append(tok)
                last = i == n - 1
                chunk = GenerateChunk(token_ids=[tok], finish_reason="length" if last else None)
                if req.prompt is not None:  # text mode: this worker detokenizes itself
                    chunk.text = f" w{i}"
                if so.logprobs is not None:
                    alt = self.text_ids[(len(ids) + 3) % len(self.text_ids)]
                    chunk.logprobs = [TokenLogprob(tok, -0.25, [(tok, -0.25), (alt, -1.5)][:so.logprobs])]
                if i == 0:
                    chunk.num_prompt_tokens = len(req.token_ids or [])
                    chunk.cached_tokens = self.cached
                if last:
                    chunk.usage = Usage(prompt_tokens=len(req.token_ids or []), completion_tokens=n,
                                        cached_tokens=self.cached)
                    if self.role == "prefill":
                        chunk.disaggregated_params = DisaggregatedParams(kv_transfer_params={
                            "do_remote_prefill": True, "remote_engine_id": self.instance,
                            "remote_block_ids": [1, 2, 3]})
                yield chunk
                if self.delay:
                    await asyncio.sleep(self.delay)
            self.completed.append(req.request_id or "")
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled.append(req.request_id or "")
            self.cancelled_at.append(time.monotonic())
            raise


class Deployment:
    """A frontend plus scripted workers on one test namespace."""

    def __init__(self, bus: BusContext, tiny_dir: str, text_ids: list[int]) -> None:
        self.bus = bus
        self.tiny_dir = tiny_dir
        self.text_ids = text_ids
        self.workers: list[ScriptedWorker] = []
        self.frontend: FrontendActor | None = None

    async def worker(self, **kw: Any) -> ScriptedWorker:
        w = ScriptedWorker(self.bus.child(), tokenizer_path=self.tiny_dir, text_ids=self.text_ids, **kw)
        await w.start()
        self.workers.append(w)
        return w

    async def start_frontend(self, **cfg: Any) -> FrontendActor:
        mc = cfg.pop("model_config", None) or ModelConfig(name=MODEL, path=self.tiny_dir)
        config = FrontendConfig(http="127.0.0.1:0", **{"stall_timeout": 1.0, **cfg})
        self.frontend = FrontendActor(self.bus.child(), config=config, model_config=mc)
        await self.frontend.start()
        return self.frontend

    @property
    def url(self) -> str:
        assert self.frontend is not None
        return f"http://127.0.0.1:{self.frontend.port}"

    async def wait_ready(self, n_workers: int, timeout: float = 15.0) -> None:
        """Until the frontend sees n ready workers and has the tokenizer loaded."""
        assert self.frontend is not None
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            if len(self.frontend.workers.ready_instances()) >= n_workers and self.frontend.workers.models:
                break
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError(f"frontend saw {self.frontend.workers.ready_instances()}")
        assert self.frontend.app is not None
        entry = next(iter(self.frontend.workers.models.values()))
        await self.frontend.app.pipeline.preprocessors.get(entry)

    async def stop(self) -> None:
        for w in self.workers:
            await w.stop(1.0)
            with contextlib.suppress(BaseException):  # a scripted death is the test's intent
                await asyncio.wait_for(w.wait(), 1.0)
        if self.frontend is not None:
            await self.frontend.stop(1.0)


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def text_ids(tiny_dir: str) -> list[int]:
    return SHARED.get((tiny_dir, None)).encode(TEXT, add_special_tokens=False)


@pytest.fixture
async def deploy(bus: BusContext, tiny_dir: str, text_ids: list[int]) -> AsyncIterator[Deployment]:
    d = Deployment(bus, tiny_dir, text_ids)
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s
