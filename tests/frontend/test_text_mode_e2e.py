"""Text mode (``model.text_mode``) through the frontend with the official client: the frontend holds no
tokenizer, workers apply the chat template, tokenize and detokenize. On the mocker (the engine actor,
no scaffolding) and on vLLM-CPU with the tiny model, where the answer must equal token mode's.

One mocker deployment and one vLLM engine for the module (the vLLM one starts only for its tests).
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

from actors.engines.mocker import tokens as tk
from actors.engines.mocker.engine import MockerEngine
from actors.frontend.actor import FrontendActor
from actors.frontend.preprocess import tool_dicts
from actors.frontend.responses import WORKER_HEADER
from actors.models.tiny import ensure_tiny_model
from actors.worker.engine_actor import EngineActor
from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.frontend.vllm_stack import VllmStack
from tests.helpers import openai_client

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

TEXT_MODEL = ModelConfig(name="tiny", path="tiny", text_mode=True)
ARGS = {"speedup_ratio": "inf", "max_model_len": 512, "block_size": 16}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about cats."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now"}}]  # no description, no parameters: nulls
VOCAB = 32000  # the mocker's default pseudo-token range


def template_ids(tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The tiny model's chat template over MSGS, as transformers renders and tokenizes it."""
    hf = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True, tools=tools)
    return hf(text, add_special_tokens=False)["input_ids"]


async def start_worker(ctx: BusContext, instance: str, role: str = "agg", **args: Any) -> EngineActor:
    w = EngineActor(ctx.child(), pool_name=role, pool=PoolConfig(engine="mocker", role=role), model=TEXT_MODEL,
                    instance=instance, load_interval=0.5,
                    engine_factory=lambda: MockerEngine({**ARGS, **args}, role=role, served_model_name="tiny"))
    await w.start()
    return w


async def start_frontend(ctx: BusContext, model: ModelConfig, workers: int, **cfg: Any) -> FrontendActor:
    fe = FrontendActor(ctx.child(), config=FrontendConfig(http="127.0.0.1:0", **cfg), model_config=model)
    await fe.start()
    for _ in range(600):
        if len(fe.workers.ready_instances()) >= workers and fe.workers.models:
            return fe
        await asyncio.sleep(0.05)
    raise TimeoutError("the frontend saw no ready worker")


class Mocker:
    def __init__(self, ctx: BusContext, fe: FrontendActor, workers: list[EngineActor]) -> None:
        self.ctx, self.fe, self.workers = ctx, fe, workers
        self.client: AsyncOpenAI = openai_client(f"http://127.0.0.1:{fe.port}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mocker(nats_server: EmbeddedNats) -> AsyncIterator[Mocker]:
    ctx = await open_context(nats_server.url, namespace="tm" + secrets.token_hex(4), host="testhost",
                             name="text-mode-test")
    workers = [await start_worker(ctx, f"m{i}") for i in range(2)]
    # kv: routes requests without tokens too; trusted request templates: the failure test sends one
    fe = await start_frontend(ctx, TEXT_MODEL, 2, router="kv", trust_request_chat_template=True)
    try:
        yield Mocker(ctx, fe, workers)
    finally:
        await fe.stop(1.0)
        for w in workers:
            await w.stop(1.0)
        await ctx.close()


# --- the mocker ----------------------------------------------------------------------------------------
async def test_chat_in_text_mode(mocker: Mocker) -> None:
    """The frontend loads no tokenizer; the worker renders and counts the prompt (usage) and
    detokenizes, streaming and not; requests without tokens are still spread over the workers."""
    c = mocker.client
    assert await mocker.fe.app.pipeline.preprocessors.get(mocker.fe.workers.models["tiny"]) is None
    ids = template_ids()
    want = tk.detokenize(tk.predict_output(ids, 6, VOCAB, ignore_eos=True))
    seen = set()
    for _ in range(2):
        raw = await c.chat.completions.with_raw_response.create(model="tiny", messages=MSGS, max_tokens=6,
                                                                extra_body={"ignore_eos": True})
        r = raw.parse()
        seen.add(raw.headers[WORKER_HEADER])
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)
    assert seen == {"m0", "m1"}
    stream = await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), 6)
    r = await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, n=2, seed=7,
                                        extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1] and r.usage.completion_tokens == 6


async def test_no_max_tokens_is_the_context_left(mocker: Mocker) -> None:
    """vLLM's chat default, although only the worker can count the prompt."""
    r = await mocker.client.chat.completions.create(model="tiny", messages=MSGS, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 512 - len(template_ids()) and r.choices[0].finish_reason == "length"


async def test_completions_in_text_mode(mocker: Mocker) -> None:
    r = await mocker.client.completions.create(model="tiny", prompt="hello", max_tokens=3,
                                               extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 3  # the mocker's byte tokens
    assert r.choices[0].text == tk.detokenize(tk.predict_output(tk.tokenize_text("hello"), 3, VOCAB,
                                                                ignore_eos=True))


async def test_token_prompts_in_text_mode(mocker: Mocker) -> None:
    """Token-id prompts need no tokenizer to send, but their text is still the worker's to write."""
    r = await mocker.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3,
                                               extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text == tk.detokenize(tk.predict_output([5, 6, 7], 3, VOCAB, ignore_eos=True))


async def test_logprobs_are_refused_in_text_mode(mocker: Mocker) -> None:
    """Their token strings need the tokenizer: a 400, not an answer silently without them."""
    c = mocker.client
    with pytest.raises(openai.BadRequestError) as ei:
        await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, logprobs=True)
    assert ei.value.body["param"] == "logprobs" and "runs in text mode" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="logprobs are not returned"):
        await c.completions.create(model="tiny", prompt="hello", max_tokens=2, logprobs=1)


async def test_tools_reach_the_template_only_with_tool_choice_none(mocker: Mocker) -> None:
    c = mocker.client
    r = await c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none",
                                        max_tokens=2, extra_body={"ignore_eos": True})
    # the tools as the token-mode frontend hands them to the template (vLLM's model_dump, nulls kept)
    as_vllm = tool_dicts([ChatCompletionToolsParam.model_validate(t) for t in TOOLS])
    assert r.usage.prompt_tokens == len(template_ids(as_vllm)) > len(template_ids())
    assert r.choices[0].message.tool_calls is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named, None):  # None: tools without tool_choice mean "auto"
        extra = {} if choice is None else {"tool_choice": choice}
        with pytest.raises(openai.BadRequestError) as ei:
            await c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=2, **extra)
        assert ei.value.body["param"] == "tool_choice" and ei.value.body["code"] == 400
        assert "model tiny runs in text mode: tool calls are not parsed" in ei.value.body["message"]


async def test_a_chat_template_failure_on_the_worker_is_a_400(mocker: Mocker) -> None:
    c = mocker.client
    with pytest.raises(openai.BadRequestError) as ei:
        await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2,
                                        extra_body={"chat_template": "{{ raise_exception('no cats here') }}"})
    assert ei.value.body == {"message": "chat template failed: no cats here", "type": "invalid_request_error",
                             "param": None, "code": 400}
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens"):
        await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "cat " * 600}],
                                        max_tokens=2)
    # the workers live on
    r = await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert r.usage.completion_tokens == 1 and all(not w.service.dead for w in mocker.workers)


async def test_a_migrated_chat_continues_exactly(mocker: Mocker) -> None:
    """The worker dies part-way through a streamed chat: the next one renders the same messages and
    continues from the produced token ids, so the client gets the very answer of an unbroken run
    (the mocker's tokens are a hash of everything before them: any other prompt would show)."""
    c = mocker.client
    want = tk.detokenize(tk.predict_output(template_ids(), 12, VOCAB, ignore_eos=True))
    # its ready probe generates one token, then 5 of ours, and its engine dies
    dying = await start_worker(mocker.ctx, "d0", die_after_tokens=6)
    try:
        for _ in range(200):
            if "d0" in mocker.fe.workers.ready_instances():
                break
            await asyncio.sleep(0.05)
        stream = await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True},
                                                 extra_headers={WORKER_HEADER: "d0"})
        chunks = [ch async for ch in stream]
        assert dying.service.dead  # it really died mid-stream
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(template_ids()), 12)
    finally:
        await dying.stop(1.0)


async def test_disaggregated_chat_in_text_mode(nats_server: EmbeddedNats) -> None:
    """Prefill and decode workers both get the chat and render the same prompt (the prefill runs it
    for its one token, the decode worker continues from its KV hand-off)."""
    ctx = await open_context(nats_server.url, namespace="td" + secrets.token_hex(4), host="testhost",
                             name="text-mode-disagg-test")
    workers = [await start_worker(ctx, "p0", role="prefill"), await start_worker(ctx, "d0", role="decode")]
    fe = await start_frontend(ctx, TEXT_MODEL, 2)
    try:
        prefill = workers[0].service.engine
        assert isinstance(prefill, MockerEngine)
        before = prefill.tokens_generated
        r = await openai_client(f"http://127.0.0.1:{fe.port}").chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=6, extra_body={"ignore_eos": True})
        ids = template_ids()
        assert r.choices[0].message.content == tk.detokenize(tk.predict_output(ids, 6, VOCAB, ignore_eos=True))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)
        assert prefill.tokens_generated == before + 1  # the prefill's one token
    finally:
        await fe.stop(1.0)
        for w in workers:
            await w.stop(1.0)
        await ctx.close()


# --- vLLM-CPU ------------------------------------------------------------------------------------------
no_vllm = importlib.util.find_spec("vllm") is None


@pytest_asyncio.fixture(loop_scope="session")
async def vllm(vllm_frontend: VllmStack) -> AsyncIterator[tuple[AsyncOpenAI, AsyncOpenAI]]:
    """The session's shared vLLM worker (in text mode: it also serves token ids, tests/conftest.py)
    and two frontends: a text-mode one started here, and the shared token-mode one. Yields
    (text-mode client, token-mode client)."""
    text_fe = await start_frontend(vllm_frontend.ctx, TEXT_MODEL, 1, stall_timeout=60.0)
    try:
        yield openai_client(f"http://127.0.0.1:{text_fe.port}", timeout=120), vllm_frontend.client
    finally:
        await text_fe.stop(2.0)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(no_vllm, reason="vllm not installed")
@pytest.mark.asyncio(loop_scope="session")  # the shared worker lives on the session loop
async def test_vllm_text_mode_chat_equals_token_mode(vllm: tuple[AsyncOpenAI, AsyncOpenAI]) -> None:
    text_c, token_c = vllm
    kw: dict[str, Any] = {"model": "tiny", "messages": MSGS, "max_tokens": 16, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}
    by_tokens = await token_c.chat.completions.create(**kw)
    by_text = await text_c.chat.completions.create(**kw)
    answer = by_tokens.choices[0].message.content
    assert answer and by_text.choices[0].message.content == answer
    usage = (by_text.usage.prompt_tokens, by_text.usage.completion_tokens)
    assert usage == (by_tokens.usage.prompt_tokens, by_tokens.usage.completion_tokens) == (len(template_ids()), 16)
    stream = await text_c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer
    assert chunks[-1].usage.completion_tokens == 16
    # stop strings: the engine enforces them in text mode, the frontend in token mode; same answer
    stop = answer[4:7]
    kw["stop"] = [stop]
    a = await text_c.chat.completions.create(**kw)
    b = await token_c.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content == answer[:answer.index(stop)]
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "stop"
