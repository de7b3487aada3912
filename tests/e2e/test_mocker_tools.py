"""Tool calling and reasoning through a deployment started as users start it:
``python -m actors.supervisor topologies/mocker-tools.toml``, driven with the official ``openai``
client (chat completions, responses) and ``anthropic`` client (messages). The mocker answers the topology's scripted text in the tiny model's tokens, one token per
step, so the frontend's vLLM parsers (hermes tool calls, qwen3 reasoning) see real streamed deltas.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.e2e.conftest import WORKER_HEADER, Deployment, boot, http_json, http_text, post, shutdown
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


# --- the same through /v1/responses (openai client) and /v1/messages (anthropic client) ---------------
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                   for f in (TOOLS[0]["function"],)]


def anthropic_client(d: Deployment) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key="none", max_retries=0, timeout=30)


def test_responses_plain_streamed_and_stored(dep: Deployment) -> None:
    c = client(dep)
    r = c.responses.create(model="tiny", input="Please think about it", instructions="Answer briefly.")
    assert r.status == "completed" and r.output_text == "The answer."
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "some reasoning"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert r.model_extra["store"] is True

    with c.responses.stream(model="tiny", input="Please think about it") as s:
        events = [e.type for e in s]
        final = s.get_final_response()
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert "response.reasoning_text.delta" in events and "response.output_text.delta" in events
    assert events.index("response.reasoning_text.delta") < events.index("response.output_text.delta")
    assert final.output_text == "The answer." and final.status == "completed"
    # what was streamed is what is stored, under the id the stream announced
    stored = c.responses.retrieve(final.id)
    assert stored.output_text == "The answer." and [o.id for o in stored.output] == [o.id for o in final.output]
    c.responses.delete(final.id)
    with pytest.raises(NotFoundError, match=f"Response with id '{final.id}' not found"):
        c.responses.retrieve(final.id)
    # store: false keeps nothing
    r = c.responses.create(model="tiny", input="hello", store=False)
    assert r.model_extra["store"] is False
    with pytest.raises(NotFoundError):
        c.responses.retrieve(r.id)


def test_responses_function_calls_and_the_follow_up(dep: Deployment) -> None:
    c = client(dep)
    forced = c.responses.create(model="tiny", input="Tell me about Paris", tools=RESPONSES_TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments), dict)  # a forced call is constrained to the schema
    required = c.responses.create(model="tiny", input="Tell me about Paris", tools=RESPONSES_TOOLS,
                                  tool_choice="required")
    assert [o.type for o in required.output] == ["function_call"] and required.output[0].name == "get_weather"

    with c.responses.stream(model="tiny", input="What is the weather in Paris?", tools=RESPONSES_TOOLS) as s:
        events = [e.type for e in s]
        auto = s.get_final_response()
    assert "response.function_call_arguments.delta" in events and "response.function_call_arguments.done" in events
    (call,) = auto.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})

    # the tool's result goes back as a follow-up of the stored response: its conversation is continued
    answer = c.responses.create(model="tiny", previous_response_id=auto.id, tools=RESPONSES_TOOLS,
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": json.dumps({"sky": "sunny"})}])
    assert answer.output_text.startswith("It is sunny in Paris") and answer.previous_response_id == auto.id
    alone = c.responses.create(model="tiny", tools=RESPONSES_TOOLS,
                               input=[{"type": "function_call_output", "call_id": call.call_id, "output": "x"}])
    assert answer.usage.input_tokens > alone.usage.input_tokens  # the first turn is in the prompt


def test_messages_plain_streamed_and_tool_use(dep: Deployment) -> None:
    a = anthropic_client(dep)
    r = a.messages.create(model="tiny", max_tokens=64, system="Answer briefly.",
                          messages=[{"role": "user", "content": [{"type": "text", "text": "Please think about it"}]}])
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "some reasoning" and r.content[1].text == "The answer."
    assert r.stop_reason == "end_turn" and r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    # count_tokens counts what the same body sends, tools included
    counted = a.messages.count_tokens(model="tiny", system="Answer briefly.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Please think about it"}]}])
    assert counted.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    with_tools = a.messages.count_tokens(model="tiny", tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Please think about it"}])
    assert with_tools.input_tokens > counted.input_tokens

    with a.messages.stream(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "hello"}]) as s:
        seen = list(s)
        final = s.get_final_message()
    events = [e.type for e in seen]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert seen[0].message.usage.input_tokens == final.usage.input_tokens > 0  # known from the start
    assert "content_block_delta" in events and "message_delta" in events
    plain = client(dep).chat.completions.create(model="tiny", messages=ask("hello"), max_tokens=64)
    assert final.content[0].text == plain.choices[0].message.content and final.stop_reason == "end_turn"

    # a stop sequence ends the text before it, and the message says which one
    stopped = a.messages.create(model="tiny", max_tokens=64, stop_sequences=["help", "never"],
                                messages=[{"role": "user", "content": "hello"}])
    assert final.content[0].text.startswith(stopped.content[0].text + "help")
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "help")

    ask_weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = a.messages.create(model="tiny", max_tokens=128, tools=ANTHROPIC_TOOLS, messages=ask_weather)
    (use,) = r.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert r.stop_reason == "tool_use" and use.id

    with a.messages.stream(model="tiny", max_tokens=128, tools=ANTHROPIC_TOOLS, messages=ask_weather,
                           tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    (forced,) = streamed.content
    assert forced.type == "tool_use" and forced.name == "get_weather" and isinstance(forced.input, dict)

    # the tool_result block goes back; the model answers in text
    r = a.messages.create(model="tiny", max_tokens=128, tools=ANTHROPIC_TOOLS, messages=[
        *ask_weather, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
    assert r.content[0].text.startswith("It is sunny in Paris") and r.stop_reason == "end_turn"


def _requests_by_endpoint(d: Deployment) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for m in re.finditer(r'^vllm_actors_frontend_requests_total\{([^}]*)\} (\S+)$', http_text(f"{d.url}/metrics"), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        key = (labels["endpoint"], labels["status"])
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def test_each_api_is_counted_under_its_endpoint(dep: Deployment) -> None:
    before = _requests_by_endpoint(dep)
    client(dep).responses.create(model="tiny", input="hello", store=False)
    anthropic_client(dep).messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    post(f"{dep.url}/v1/messages", {"model": "tiny", "messages": []})
    after = _requests_by_endpoint(dep)
    grew = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert grew == {("responses", "200"): 1.0, ("messages", "200"): 1.0, ("messages", "400"): 1.0}, grew


def test_bad_input_gets_each_apis_error_shape(dep: Deployment) -> None:
    bad_messages = {"model": "tiny", "max_tokens": "many", "messages": [{"role": "user", "content": "hi"}]}
    code, _, text = post(f"{dep.url}/v1/messages", bad_messages)
    body = json.loads(text)
    assert code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", text
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        anthropic_client(dep).messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client(dep).messages.create(model="tiny", max_tokens=4, messages=[])

    c = client(dep)
    with pytest.raises(BadRequestError, match="input"):
        c.responses.create(model="tiny", input=5)  # type: ignore[arg-type]
    with pytest.raises(NotFoundError, match="Response with id 'resp_nope' not found"):
        c.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    with pytest.raises(BadRequestError, match="not supported"):
        c.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    with pytest.raises(BadRequestError, match="background"):
        c.responses.create(model="tiny", input="x", background=True)
    for rid in ("*", "a.b", ">"):  # never a KV wildcard or another subject
        code, err = http_json(f"{dep.url}/v1/responses/{urllib.parse.quote(rid)}")
        assert code == 404 and err["error"]["type"] == "not_found_error", (rid, err)



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


async def test_a_messages_stream_survives_a_worker_kill(slow: Deployment) -> None:
    """/v1/messages rides the chat pipeline's migration: its serving worker is SIGKILLed after the
    first tool_use block began, and the anthropic client still reads both blocks whole."""
    # the serving worker is named by the response's header (after the next restart it is another)
    before = set(slow.instances("agg"))
    a = anthropic.AsyncAnthropic(base_url=slow.url, api_key="none", max_retries=0, timeout=60)
    killed = False
    async with a.messages.stream(model="tiny", max_tokens=256, tools=ANTHROPIC_TOOLS,
                                 messages=[{"role": "user", "content": "Compare the two cities Paris and London"}]
                                 ) as s:
        serving = s.response.headers[WORKER_HEADER]
        async for event in s:
            if event.type == "content_block_delta" and not killed:
                await kill_serving_worker(slow, serving)
                killed = True
        final = await s.get_final_message()
    assert killed and serving in before
    assert [(b.type, b.name, b.input) for b in final.content] == \
        [("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_weather", {"city": "London"})]
    assert final.stop_reason == "tool_use"
