"""The OpenAI surface through the official client and raw HTTP, against scripted workers on real NATS."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from actors.frontend.responses import WORKER_HEADER
from tests.helpers import openai_client

MODEL = "tiny"  # served name the scripted workers register (conftest)


def client(d: Any, **kw) -> AsyncOpenAI:
    return openai_client(d.url, **kw)


@pytest.fixture
async def agg(deploy: Any) -> Any:
    await deploy.worker(delay=0.01)
    await deploy.start_frontend()
    await deploy.wait_ready(1)
    return deploy


async def test_chat_non_streaming(agg: Any) -> None:
    c = client(agg)
    raw = await c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    r = raw.parse()
    assert raw.headers[WORKER_HEADER] == agg.workers[0].instance
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 5
    req = agg.workers[0].requests[-1]
    assert r.usage.prompt_tokens == len(req.token_ids) and r.usage.total_tokens == len(req.token_ids) + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert req.sampling.max_tokens == 5 and req.sampling.detokenize is False


async def test_chat_text_is_the_detokenized_worker_tokens(agg: Any, text_ids: list[int]) -> None:
    c = client(agg)
    r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=6, temperature=0)
    req = agg.workers[0].requests[-1]
    pre = agg.frontend.app.pipeline.preprocessors.cache.peek((agg.tiny_dir, None))
    p = len(req.token_ids)
    produced = [text_ids[(p + i) % len(text_ids)] for i in range(6)]
    assert r.choices[0].message.content == pre.decode(produced)


async def test_chat_streaming_with_usage(agg: Any) -> None:
    c = client(agg)
    stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=7, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert text.strip()


async def test_completions_streaming_and_not(agg: Any) -> None:
    c = client(agg)
    r = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert r.object == "text_completion" and r.usage.completion_tokens == 4
    stream = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True)
    text = "".join([ch.choices[0].text async for ch in stream])
    assert text == r.choices[0].text


async def test_n2_fans_out_with_seeds(agg: Any) -> None:
    c = client(agg)
    r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3, n=2, seed=7)
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    seeds = sorted(q.sampling.seed for q in agg.workers[0].requests[-2:])
    assert seeds == [7, 8]
    assert r.usage.completion_tokens == 6
    stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3, n=2, stream=True)
    done = {ch.choices[0].index for ch in [x async for x in stream] if ch.choices and ch.choices[0].finish_reason}
    assert done == {0, 1}


async def test_stop_string_across_chunks(agg: Any, text_ids: list[int]) -> None:
    c = client(agg)
    # the worker emits "... three four ..." one token per chunk; "ee fo" spans several tokens
    r = await c.completions.create(model=MODEL, prompt="count:", max_tokens=30, stop=["ee fo"])
    p = len(agg.workers[0].requests[-1].token_ids)
    full = agg.frontend.app.pipeline.preprocessors.cache.peek((agg.tiny_dir, None)).decode(
        [text_ids[(p + i) % len(text_ids)] for i in range(30)])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == "ee fo"
    assert r.choices[0].text == full[:full.index("ee fo")]
    stream = await c.completions.create(model=MODEL, prompt="count:", max_tokens=30, stop=["ee fo"],
                                        stream=True)
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the worker was told to stop (cancel) instead of producing all 30 tokens
    for _ in range(100):
        if len(agg.workers[0].cancelled) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(agg.workers[0].cancelled) == 2 and not agg.workers[0].completed


async def test_logprobs_chat_and_completions(agg: Any) -> None:
    c = client(agg)
    r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == -0.25
    assert agg.workers[0].requests[-1].sampling.logprobs == 2
    r2 = await c.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=1)
    lp = r2.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs == [-0.25] * 3 and len(lp.top_logprobs[0]) == 1


async def test_response_format_json_schema_reaches_worker(agg: Any) -> None:
    c = client(agg)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    so = agg.workers[0].requests[-1].sampling.structured
    assert so is not None and so.json == schema
    await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    response_format={"type": "json_object"})
    assert agg.workers[0].requests[-1].sampling.structured.json_object is True


async def test_sampling_fields_mapped(agg: Any) -> None:
    c = client(agg)
    await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3,
        temperature=0.3, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.25, seed=11,
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "min_tokens": 2,
                    "repetition_penalty": 1.1})
    s = agg.workers[0].requests[-1].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (3, 0.3, 0.9, 5, 0.1, 11)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert s.ignore_eos and s.min_tokens == 2


async def test_max_tokens_defaults_to_context_left(agg: Any) -> None:
    c = client(agg)
    stream = await c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], stream=True)
    async for _ in stream:
        break  # only the request matters; closing the stream cancels it
    await stream.close()
    assert agg.workers[0].requests[-1].sampling.max_tokens == 1024 - 4


async def test_sse_framing_raw(agg: Any, http) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with http.post(agg.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers[WORKER_HEADER] == agg.workers[0].instance
        raw = await resp.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith(b"data: ") and b"\n" not in ev
        obj = json.loads(ev[6:])
        assert obj["object"] == "chat.completion.chunk" and obj["model"] == MODEL
    assert len(events) - 2 == 1 + 3  # role chunk + one per token (last carries finish_reason)


async def test_models_health_live_metrics(agg: Any, http) -> None:
    models = await client(agg).models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with http.get(agg.url + "/health") as r:
        h = await r.json()
        assert r.status == 200 and h["instances"][0]["instance"] == agg.workers[0].instance
    async with http.get(agg.url + "/live") as r:
        assert r.status == 200
    await client(agg).completions.create(model=MODEL, prompt="x", max_tokens=2)
    async with http.get(agg.url + "/metrics") as r:
        text = await r.text()
    assert 'vllm_actors_frontend_requests_total{endpoint="completions",model="tiny",status="200"}' in text
    assert "vllm_actors_frontend_time_to_first_token_seconds_bucket" in text
    # latency by model and the pool of the worker that produced the tokens
    for family in ("time_to_first_token_seconds", "request_duration_seconds"):
        assert f'vllm_actors_frontend_{family}_count{{model="tiny",pool="agg"}} 1.0' in text, family
    stream = await client(agg).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                       max_tokens=3, stream=True)
    assert len([c async for c in stream]) > 2
    async with http.get(agg.url + "/metrics") as r:
        text = await r.text()
    assert re.search(r'^vllm_actors_frontend_inter_token_latency_seconds_count\{model="tiny",pool="agg"\} [1-9]',
                     text, re.M), "no inter-token latency by pool"


async def test_health_503_without_workers(deploy: Any, http) -> None:
    await deploy.start_frontend()
    async with http.get(deploy.url + "/health") as r:
        assert r.status == 503
    w = await deploy.worker()
    await deploy.wait_ready(1)
    async with http.get(deploy.url + "/health") as r:
        assert r.status == 200
    await w.stop(1.0)  # deregistered: never chosen again
    for _ in range(100):
        if not deploy.frontend.workers.ready_instances():
            break
        await asyncio.sleep(0.05)
    with pytest.raises(openai.APIStatusError) as ei:
        await client(deploy).completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ei.value.status_code == 503
