"""Tool calling and reasoning through a deployment started as users start it:
``python -m actors.supervisor topologies/mocker-tools.toml``, driven with the official ``openai``
client. The mocker answers the topology's scripted text in the tiny model's tokens, one token per
step, so the frontend's vLLM parsers (hermes tool calls, qwen3 reasoning) see real streamed deltas.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.conftest import WORKER_HEADER, Deployment, boot, shutdown
from tests.e2e.test_mocker_deployments import kill_serving_worker
from tests.helpers import openai_client

# The rendered tool list is part of the prompt, and the script answers the first entry whose
# trigger occurs in it: the description avoids the trigger words, and the name "get_weather" (which
# the script's calls use) reaches the "weather" entry only when no earlier entry matched.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current conditions in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "tools", "mocker-tools.toml", ready={"agg": 1})
    try:
        yield d
    finally:
        shutdown(d)


def client(d: Deployment) -> OpenAI:
    return OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=30)


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def collect(stream: Any) -> tuple[dict[int, dict[str, str]], str, str, list[str | None]]:
    """A stream's tool calls by index (id, name, arguments joined), its content, its reasoning, and
    the finish reasons seen."""
    calls: dict[int, dict[str, str]] = {}
    content = reasoning = ""
    finishes: list[str | None] = []
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        finishes.append(ch.choices[0].finish_reason)
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert not c["id"], "a call's id comes once, on its first piece"
                c["id"] = tc.id
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return calls, content, reasoning, finishes


def test_auto_tool_call(dep: Deployment) -> None:
    c = client(dep)
    r = c.chat.completions.create(model="tiny", messages=ask("What is the weather in Paris?"), tools=TOOLS)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == \
        [("function", "get_weather", {"city": "Paris"})]
    assert msg.tool_calls[0].id and not msg.content

    calls, content, _, finishes = collect(c.chat.completions.create(
        model="tiny", messages=ask("What is the weather in Paris?"), tools=TOOLS, stream=True))
    assert list(calls) == [0] and calls[0]["id"] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finishes[-1] == "tool_calls" and not content.strip()
    assert sum(1 for f in finishes if f is None) > 3  # the arguments arrived in several pieces


def test_parallel_tool_calls(dep: Deployment) -> None:
    c = client(dep)
    msgs = ask("Compare the two cities Paris and London")
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
    calls = r.choices[0].message.tool_calls
    assert [json.loads(t.function.arguments)["city"] for t in calls] == ["Paris", "London"]
    assert len({t.id for t in calls}) == 2 and r.choices[0].finish_reason == "tool_calls"
    streamed, _, _, finishes = collect(c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                                                 stream=True))
    assert [json.loads(streamed[i]["arguments"])["city"] for i in sorted(streamed)] == ["Paris", "London"]
    assert finishes[-1] == "tool_calls"
    # parallel_tool_calls=false: only the first call, as vllm serve filters it
    one = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    first, _, _, _ = collect(c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, stream=True,
                                                       parallel_tool_calls=False))
    assert list(first) == [0]


def test_required_and_named_parse_the_models_format(dep: Deployment) -> None:
    """With hermes configured, "required" and named tools go through the parser's own format (its
    structural tag constrains a vLLM engine; the mocker answers the script's call)."""
    c = client(dep)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(model="tiny", messages=ask("What is the weather in Paris?"), tools=TOOLS,
                                      tool_choice=choice)  # type: ignore[arg-type]
        calls = r.choices[0].message.tool_calls
        assert [t.function.name for t in calls] == ["get_weather"]
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_tool_choice_none_leaves_the_text_alone(dep: Deployment) -> None:
    r = client(dep).chat.completions.create(model="tiny", messages=ask("What is the weather in Paris?"),
                                            tools=TOOLS, tool_choice="none")
    msg = r.choices[0].message
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert '"name": "get_weather"' in msg.content  # the model's text, not parsed


def test_reasoning_is_split_from_the_answer(dep: Deployment) -> None:
    c = client(dep)
    r = c.chat.completions.create(model="tiny", messages=ask("Please think about it"))
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "some reasoning" == msg.model_extra["reasoning"]
    assert msg.content == "The answer." and r.choices[0].finish_reason == "stop"
    _, content, reasoning, finishes = collect(c.chat.completions.create(
        model="tiny", messages=ask("Please think about it"), stream=True))
    assert (reasoning, content, finishes[-1]) == ("some reasoning", "The answer.", "stop")
    # include_reasoning=false: vLLM's switch to drop it
    r = c.chat.completions.create(model="tiny", messages=ask("Please think about it"),
                                  extra_body={"include_reasoning": False})
    assert "reasoning_content" not in r.choices[0].message.model_extra and r.choices[0].message.content


def test_reasoning_then_tool_call(dep: Deployment) -> None:
    c = client(dep)
    msgs = ask("Please think and call the tool")
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
    msg = r.choices[0].message
    assert "call the tool" in msg.model_extra["reasoning_content"]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"
    calls, content, reasoning, finishes = collect(c.chat.completions.create(model="tiny", messages=msgs,
                                                                            tools=TOOLS, stream=True))
    assert "call the tool" in reasoning and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finishes[-1] == "tool_calls" and not content.strip()


def test_tool_result_round_trip(dep: Deployment) -> None:
    """An agent's second turn: the assistant's call and the tool's result go back in the messages
    (rendered by the chat template), and the model answers in plain content."""
    c = client(dep)
    first = c.chat.completions.create(model="tiny", messages=ask("What is the weather in Paris?"), tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    msgs = [*ask("What is the weather in Paris?"),
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny"})}]
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
    assert r.choices[0].message.content.startswith("It is sunny in Paris")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert "reasoning_content" not in r.choices[0].message.model_extra  # the empty think block is dropped



@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory, dep: Deployment) -> Iterator[Deployment]:
    """Two mocker workers at a tenth of real speed: a reply takes long enough to SIGKILL its worker
    in the middle of it."""
    shutdown(dep)  # one deployment at a time on the shared machine
    d = boot(tmp_path_factory, "toolsslow", "mocker-tools.toml", ready={"agg": 2},
             sets=["pools.agg.replicas=2", "pools.agg.engine_args.speedup_ratio=0.1",
                   "supervisor.backoff.initial=0.1", "frontend.stall_timeout=3"])
    try:
        yield d
    finally:
        shutdown(d)


async def test_tool_calls_survive_a_worker_kill(slow: Deployment) -> None:
    """The worker writing the tool calls is SIGKILLed after the first call's first pieces: the rest
    comes from the other worker with the produced tokens appended, and the frontend's parser, which
    saw one unbroken stream, returns both calls whole."""
    c = openai_client(slow.url, timeout=60)
    raw = await c.chat.completions.with_raw_response.create(
        model="tiny", messages=ask("Compare the two cities Paris and London"), tools=TOOLS, stream=True)
    serving, stream = raw.headers[WORKER_HEADER], raw.parse()
    calls: dict[int, dict[str, str]] = {}
    finishes: list[str | None] = []
    killed = False
    async for ch in stream:
        if not ch.choices:
            continue
        finishes.append(ch.choices[0].finish_reason)
        for tc in ch.choices[0].delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        if calls and not killed:
            await kill_serving_worker(slow, serving)
            killed = True
    assert killed and finishes[-1] == "tool_calls"
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]
    assert "migrating" in slow.output(200_000)
