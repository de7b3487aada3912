"""Tool calling and structured output at the frontend, against scripted workers on a real bus:
what happens to a constrained request when its worker dies, and the 400s for tool requests that
cannot be served."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from actors.frontend.responses import WORKER_HEADER
from config.topology import ModelConfig
from tests.frontend.conftest import MODEL
from tests.helpers import openai_client

pytestmark = pytest.mark.asyncio

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MSGS = [{"role": "user", "content": "weather in Paris?"}]


def client(deploy: Any) -> openai.AsyncOpenAI:
    return openai_client(deploy.url)


@pytest.mark.parametrize("kind", ["named", "required", "json_schema"])
async def test_constrained_request_is_not_resumed_after_a_death(deploy: Any, kind: str) -> None:
    """A worker dies after producing tokens under a grammar: the engine that would continue has no
    grammar state, so the frontend fails the request (503) instead of migrating it."""
    dying = await deploy.worker(die_after=3, delay=0.01)
    healthy = await deploy.worker(delay=0.01)
    await deploy.start_frontend()
    await deploy.wait_ready(2)
    kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": NAMED if kind == "named" else "required"}
    if kind == "json_schema":
        kw = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": TOOLS[0]["function"]["parameters"]}}}
    with pytest.raises(openai.APIStatusError) as ei:
        await client(deploy).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10,
                                                     extra_headers={WORKER_HEADER: dying.instance}, **kw)
    assert ei.value.status_code == 503
    assert "cannot resume its grammar" in ei.value.body["message"]
    assert healthy.requests == []  # nothing was re-sent with a restarted grammar
    # the same request without a grammar migrates as before
    r = await client(deploy).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10)
    assert r.choices[0].finish_reason == "length"


async def test_constrained_stream_ends_with_an_error_event(deploy: Any) -> None:
    dying = await deploy.worker(die_after=3, delay=0.01)
    await deploy.worker(delay=0.01)
    await deploy.start_frontend()
    await deploy.wait_ready(2)
    stream = await client(deploy).chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=10, tools=TOOLS, tool_choice="required", stream=True,
        extra_headers={WORKER_HEADER: dying.instance})
    with pytest.raises(openai.APIError, match="cannot resume its grammar"):
        async for _ in stream:
            pass


async def test_tool_requests_that_cannot_be_served_are_400s(deploy: Any) -> None:
    await deploy.worker()
    await deploy.start_frontend()  # the topology names no tool-call parser
    await deploy.wait_ready(1)
    c = client(deploy)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS}, "tool-call parser"),  # tool_choice defaults to "auto"
        ({"tools": TOOLS, "tool_choice": "auto"}, "model.tool_call_parser"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "does not match"),
        ({"tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        ({"tools": "garbage"}, "tools"),
        ({"tools": []}, "empty"),
    ]
    for kw, words in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, **kw)
        body = ei.value.body
        assert words in body["message"], (kw, body)
        assert body["type"] == "invalid_request_error"


async def test_unusable_parser_is_a_clear_500_and_plain_chat_still_serves(deploy: Any) -> None:
    """A parser vLLM knows but the tokenizer lacks the tokens for (the tiny tokenizer has no
    [TOOL_CALLS] token for mistral's): requests that need it fail naming the setting."""
    await deploy.worker()
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir,
                                                         tool_call_parser="mistral"))
    await deploy.wait_ready(1)
    c = client(deploy)
    with pytest.raises(openai.InternalServerError) as ei:
        await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, tools=TOOLS)
    assert "model.tool_call_parser='mistral'" in ei.value.body["message"]
    r = await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    assert r.choices[0].message.content


async def test_a_request_chat_template_needs_the_operators_trust(deploy: Any, http: Any) -> None:
    """A template is code from the client (a sandboxed Jinja loop can still run for minutes): refused
    unless frontend.trust_request_chat_template is set, as vllm serve's --trust-request-chat-template."""
    await deploy.worker()
    await deploy.start_frontend()
    await deploy.wait_ready(1)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(openai.BadRequestError) as ei:
        await client(deploy).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2,
                                                     extra_body={"chat_template": template})
    assert "frontend.trust_request_chat_template" in ei.value.body["message"]
    assert ei.value.body["param"] == "chat_template"
    async with http.post(deploy.url + "/tokenize", json={"model": MODEL, "messages": MSGS,
                                                         "chat_template": template}) as resp:
        assert resp.status == 400 and "trust_request_chat_template" in (await resp.json())["error"]["message"]
    # without one, the model's template serves as before
    r = await client(deploy).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert r.choices[0].message.content
