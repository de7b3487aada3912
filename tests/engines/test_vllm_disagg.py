"""Disaggregated prefill → decode between two vLLM-CPU engines (NixlConnector; ExampleConnector
when nixl is not installed). The decode engine's tokens must equal an aggregated run."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from vllm_helpers import TEST_ENGINE_ARGS, collect, cpu_bind, free_tcp_port, greedy, needs_vllm, tokens_of

from actors.engines.protocol import TokensPrompt

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

# VLLM_ACTORS_TEST_CONNECTOR=example exercises the fallback even where nixl is installed.
HAVE_NIXL = (importlib.util.find_spec("nixl") is not None
             and os.environ.get("VLLM_ACTORS_TEST_CONNECTOR", "nixl") != "example")


def kv_transfer(role: str, shared_dir: Path) -> dict[str, Any]:
    if HAVE_NIXL:
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, Any]]:
    from actors.engines.vllm_engine import VllmEngine

    shared = tmp_path_factory.mktemp("kv")
    engines = []
    try:
        for i, (role, kv_role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
            # Explicit core per engine: with a KV connector vLLM's `auto` binder wants a spare core.
            env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(i),
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_tcp_port())}
            engine = VllmEngine({**TEST_ENGINE_ARGS, "kv_transfer_config": kv_transfer(kv_role, shared)},
                                role=role, env=env)
            await engine.start()  # one after the other: building concurrently gains nothing on 2 cores
            engines.append(engine)
        yield engines[0], engines[1]
    finally:
        for engine in engines:
            await engine.shutdown()


async def test_roles_and_kv_events(pair) -> None:
    prefill, decode = pair
    assert prefill.kv_event_sources() and not decode.kv_event_sources()


async def test_prefill_then_decode_equals_aggregated(pair) -> None:
    prefill, decode = pair
    ids = [5 + (i * 104729) % 2000 for i in range(200)]
    # Reference: the decode engine on its own (no KV handed over), then forget its cached prefix.
    reference = tokens_of(await collect(decode, TokensPrompt(ids), greedy(24), "ref-1"))
    assert await decode.reset_prefix_cache()

    pre = await collect(prefill, TokensPrompt(ids), greedy(24), "pd-1")
    assert len(tokens_of(pre)) == 1  # the prefill role forces max_tokens=1
    params = pre[-1].kv_transfer_params
    if HAVE_NIXL:
        assert params and params["do_remote_prefill"] and params["remote_block_ids"]
    out = await collect(decode, TokensPrompt(ids), greedy(24), "pd-2", kv_transfer_params=params)
    assert tokens_of(out) == reference
    assert out[-1].finish_reason == "length"
    # The decode engine really used the handed-over KV instead of recomputing the prompt
    # (NIXL: all 200 tokens pulled, reported as connector hits; files: the 192 full-block tokens).
    assert decode.stats_sink.external_hits.get(0, 0) >= 192
