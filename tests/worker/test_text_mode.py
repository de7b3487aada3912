"""Text mode at the worker (model.text_mode): it applies the chat template of a ``GenerateRequest.chat``
and runs the prompt's token ids, on the mocker without NATS (EngineService)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from transformers import AutoTokenizer

from actors.engines.mocker import tokens as tk
from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import SamplingOptions
from actors.frontend.preprocess import Preprocessor
from actors.models.tiny import ensure_tiny_model
from actors.worker.chat_render import ChatRenderer
from actors.worker.contract import ChatPrompt, GenerateChunk, GenerateRequest
from actors.worker.metrics import WorkerMetrics
from actors.worker.serving import EngineService
from bus.errors import BadRequest
from config.topology import ModelConfig, PoolConfig

ARGS = {"speedup_ratio": "inf", "max_model_len": 256}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about cats."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def service(model: ModelConfig) -> EngineService:
    return EngineService(lambda: MockerEngine(dict(ARGS), role="agg"), PoolConfig(engine="mocker"),
                         model=model, metrics=WorkerMetrics("i", "tiny"))


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


@pytest.fixture
async def svc() -> AsyncIterator[EngineService]:
    s = service(ModelConfig(name="tiny", path="tiny", text_mode=True))
    await s.start()
    yield s
    await s.shutdown()


def chat_req(max_tokens: int = 6, **kw: Any) -> GenerateRequest:
    chat = ChatPrompt(messages=kw.pop("messages", MSGS), **kw)
    return GenerateRequest(chat=chat, sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True))


async def collect(svc: EngineService, req: GenerateRequest) -> list[GenerateChunk]:
    return [c async for c in svc.generate(req)]


def output_ids(chunks: list[GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def template_ids(tiny: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """What transformers itself renders and tokenizes for MSGS (the template writes BOS)."""
    hf = AutoTokenizer.from_pretrained(tiny)
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True, tools=tools)
    return hf(text, add_special_tokens=False)["input_ids"]


async def test_chat_is_rendered_and_run_as_the_templates_token_ids(svc: EngineService, tiny: str) -> None:
    chunks = await collect(svc, chat_req(max_tokens=6))
    ids = template_ids(tiny)
    last = chunks[-1]
    assert last.usage is not None and (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), 6)
    # the mocker's output is a function of the prompt ids: the worker ran exactly the template's
    assert output_ids(chunks) == tk.predict_output(ids, 6, 32000, ignore_eos=True)
    assert "".join(c.text or "" for c in chunks) == tk.detokenize(output_ids(chunks))  # detokenized here
    # one rendering for both sides: the frontend's (token mode) gives the same ids
    pre = Preprocessor(tiny)
    assert pre.encode(pre.render_chat(MSGS), False) == ids


async def test_tools_reach_the_template(svc: EngineService, tiny: str) -> None:
    chunks = await collect(svc, chat_req(max_tokens=1, tools=TOOLS))
    with_tools = template_ids(tiny, TOOLS)
    assert len(with_tools) > len(template_ids(tiny))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(with_tools)


async def test_a_continuation_resumes_exactly_where_the_output_stopped(svc: EngineService) -> None:
    """A migrated chat: the same messages plus the ids produced so far continue the very same output."""
    whole = output_ids(await collect(svc, chat_req(max_tokens=8)))
    rest = await collect(svc, chat_req(max_tokens=5, continuation=whole[:3]))
    assert output_ids(rest) == whole[3:]


async def test_no_max_tokens_fills_the_context(svc: EngineService, tiny: str) -> None:
    n_prompt = len(template_ids(tiny))
    chunks = await collect(svc, chat_req(max_tokens=256, fit_max_tokens=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 256 - n_prompt
    assert chunks[-1].finish_reason == "length"
    with pytest.raises(BadRequest, match="maximum context length is 256 tokens"):  # a bound it keeps
        await collect(svc, chat_req(max_tokens=256))


@pytest.mark.parametrize("kw,words", [
    ({"chat_template": "{{ raise_exception('no system messages') }}"}, "chat template failed: no system messages"),
    ({"chat_template": "{% for m in messages %}"}, "chat template failed"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat template failed"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "content part type 'image_url' is not supported"),
    ({"messages": []}, "messages must not be empty"),
])
async def test_template_failures_are_400s(svc: EngineService, kw: dict[str, Any], words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        await collect(svc, chat_req(**kw))
    assert svc.in_flight() == 0
    assert (await collect(svc, chat_req(max_tokens=1)))[-1].finish_reason == "length"  # still serving


async def test_chat_and_another_prompt_is_refused(svc: EngineService) -> None:
    with pytest.raises(BadRequest, match="exactly one of token_ids, prompt, prompt_embeds, chat"):
        await collect(svc, msgspec.structs.replace(chat_req(), token_ids=[1, 2]))


async def test_a_long_chat_meets_the_context_check(svc: EngineService) -> None:
    long = [{"role": "user", "content": "cat " * 300}]
    with pytest.raises(BadRequest, match=r"maximum context length is 256 tokens. However, you requested \d+"):
        await collect(svc, chat_req(messages=long, max_tokens=4))


@pytest.mark.parametrize("model,words", [
    (ModelConfig(name="tiny", path="tiny"), r"model tiny is not in text mode \(model.text_mode\), so its workers"),
    (ModelConfig(name="tiny", path="/nonexistent/model", text_mode=True),
     "could not load the tokenizer of model tiny"),
    (ModelConfig(name="tiny", path="mock", text_mode=True), "names no tokenizer this worker can load"),
])
async def test_a_worker_that_cannot_render_says_why(model: ModelConfig, words: str) -> None:
    s = service(model)
    await s.start()
    try:
        with pytest.raises(BadRequest, match=words):
            await collect(s, chat_req())
        text = await collect(s, GenerateRequest(prompt="hello", sampling=SamplingOptions(max_tokens=2)))
        assert text[-1].finish_reason is not None  # completions in text mode are served regardless
    finally:
        await s.shutdown()


def test_the_topologys_template_file_wins(tmp_path: Any, tiny: str) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    r = ChatRenderer(tiny, str(f))
    hf = AutoTokenizer.from_pretrained(tiny)
    assert r.prompt_ids(ChatPrompt(messages=MSGS)) == hf("[system] Be brief.\n[user] Tell me about cats.\n",
                                                          add_special_tokens=False)["input_ids"]
    # a request's own template wins over both
    assert r.prompt_ids(ChatPrompt(messages=MSGS, chat_template="x")) == hf("x", add_special_tokens=False)["input_ids"]
