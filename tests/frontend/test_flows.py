"""Disaggregation, migration, cancellation on client disconnect and LoRA selection, end to end over
real NATS with scripted workers (tests/frontend/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from actors.frontend.responses import PREFILL_HEADER, WORKER_HEADER
from actors.worker.contract import LoraRecord
from bus.context import open_context
from bus.embedded import EmbeddedNats, free_port
from bus.registry import Registry
from config.topology import ModelConfig
from tests.frontend.conftest import Deployment, ScriptedWorker
from tests.helpers import openai_client

MODEL = "tiny"


def client(d: Any) -> AsyncOpenAI:
    return openai_client(d.url)


async def until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


# --- disaggregation --------------------------------------------------------------------------------
async def test_disaggregated_flow(deploy: Any) -> None:
    prefill = await deploy.worker(role="prefill", pool="prefill", cached_tokens=32)
    decode = await deploy.worker(role="decode", pool="decode")
    await deploy.start_frontend()
    await deploy.wait_ready(2)
    raw = await client(deploy).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    r = raw.parse()
    assert raw.headers[PREFILL_HEADER] == prefill.instance
    assert raw.headers[WORKER_HEADER] == decode.instance
    preq, dreq = prefill.requests[-1], decode.requests[-1]
    assert preq.sampling.max_tokens == 1 and preq.token_ids == dreq.token_ids
    assert dreq.prefill_result is not None
    assert dreq.prefill_result.kv_transfer_params == {"do_remote_prefill": True,
                                                      "remote_engine_id": prefill.instance,
                                                      "remote_block_ids": [1, 2, 3]}
    assert dreq.prefill_result.prefill_instance == prefill.instance
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens_details.cached_tokens == 32

    # streaming: both headers are known before the first byte
    async with __import__("aiohttp").ClientSession() as http:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
        async with http.post(deploy.url + "/v1/completions", json=body) as resp:
            assert resp.headers[PREFILL_HEADER] == prefill.instance
            assert resp.headers[WORKER_HEADER] == decode.instance
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_disagg_falls_back_to_decode_only(deploy: Any) -> None:
    prefill = await deploy.worker(role="prefill", pool="prefill")
    decode = await deploy.worker(role="decode", pool="decode")
    # decode-only fallback is off unless the topology allows it (a disaggregated deployment is
    # otherwise ready only with both pools)
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir,
                                                         allow_decode_only=True))
    await deploy.wait_ready(2)
    await prefill.stop(1.0)
    await until(lambda: not deploy.frontend.workers.workers(MODEL, "prefill"))
    raw = await client(deploy).completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
    assert PREFILL_HEADER not in raw.headers and raw.headers[WORKER_HEADER] == decode.instance
    assert decode.requests[-1].prefill_result is None


async def test_disagg_without_decode_only_is_503(deploy: Any) -> None:
    prefill = await deploy.worker(role="prefill", pool="prefill")
    await deploy.worker(role="decode", pool="decode")
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir,
                                                         allow_decode_only=False))
    await deploy.wait_ready(2)
    await prefill.stop(1.0)
    await until(lambda: not deploy.frontend.workers.workers(MODEL, "prefill"))
    with pytest.raises(openai.APIStatusError) as ei:
        await client(deploy).completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ei.value.status_code == 503


# --- migration -----------------------------------------------------------------------------------
async def test_migration_completes_the_stream(deploy: Any, text_ids: list[int]) -> None:
    dying = await deploy.worker(die_after=4, delay=0.01)
    healthy = await deploy.worker(delay=0.01)
    await deploy.start_frontend()
    await deploy.wait_ready(2)
    c = client(deploy)
    stream = await c.completions.create(model=MODEL, prompt=[9, 9, 9], max_tokens=12, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_headers={WORKER_HEADER: dying.instance})
    chunks = [ch async for ch in stream]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    pre = deploy.frontend.app.pipeline.preprocessors.cache.peek((deploy.tiny_dir, None))
    expect = pre.decode([text_ids[(3 + i) % len(text_ids)] for i in range(12)])
    assert text == expect  # one unbroken stream, no token lost or repeated
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 3
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # the second worker got the prompt plus the 4 produced tokens and the remaining budget
    req = healthy.requests[-1]
    assert req.token_ids[:3] == [9, 9, 9] and len(req.token_ids) == 3 + 4
    assert req.sampling.max_tokens == 8
    metrics = deploy.frontend.metrics.render().decode()
    assert 'vllm_actors_frontend_model_migration_total{model="tiny"} 1.0' in metrics


async def test_single_worker_restarted_in_place_continues_the_stream(deploy: Any, text_ids: list[int]) -> None:
    """The only worker dies mid-stream and comes back under the same instance id (an engine restarted
    in place by its worker supervisor): the frontend waits for it and the client's stream completes."""
    dying = await deploy.worker(die_after=4, delay=0.01)
    await deploy.start_frontend()
    await deploy.wait_ready(1)

    async def restart_in_place() -> ScriptedWorker:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(dying.wait(), 10)  # the scripted death tore it down (deregistered)
        await asyncio.sleep(0.5)  # "engine start"
        return await deploy.worker(delay=0.01, instance=dying.instance)

    restarter = asyncio.create_task(restart_in_place())
    stream = await client(deploy).completions.create(model=MODEL, prompt=[9, 9, 9], max_tokens=12, stream=True,
                                                     stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    back = await restarter
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    pre = deploy.frontend.app.pipeline.preprocessors.cache.peek((deploy.tiny_dir, None))
    assert text == pre.decode([text_ids[(3 + i) % len(text_ids)] for i in range(12)])
    assert chunks[-1].usage.completion_tokens == 12
    assert back.requests and back.requests[-1].sampling.max_tokens == 8  # the rest, on the new incarnation


async def test_migration_gives_up_when_no_worker_comes_back(deploy: Any) -> None:
    await deploy.worker(die_after=2, delay=0.01)
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir, migration_wait=0.5))
    await deploy.wait_ready(1)
    with pytest.raises(openai.APIStatusError) as ei:
        await asyncio.wait_for(client(deploy).completions.create(model=MODEL, prompt=[1, 2], max_tokens=10), 20)
    assert ei.value.status_code in (500, 503) and "came back" in str(ei.value.body)


async def test_migration_limit_zero_is_a_clean_error(deploy: Any) -> None:
    dying = await deploy.worker(die_after=2)
    await deploy.worker()
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir, migration_limit=0))
    await deploy.wait_ready(2)
    async with __import__("aiohttp").ClientSession() as http:
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 10, "stream": True}
        async with http.post(deploy.url + "/v1/completions", json=body,
                             headers={WORKER_HEADER: dying.instance}) as resp:
            assert resp.status == 200
            events = (await asyncio.wait_for(resp.read(), 10)).split(b"\n\n")
    assert events[-2] == b"data: [DONE]"
    err = json.loads(events[-3][6:])["error"]
    assert err["code"] == 500 and "migration limit 0" in err["message"]


async def test_migration_limit_zero_non_streaming_500(deploy: Any) -> None:
    dying = await deploy.worker(die_after=2)
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir, migration_limit=0))
    await deploy.wait_ready(1)
    with pytest.raises(openai.InternalServerError) as ei:
        await client(deploy).completions.create(model=MODEL, prompt=[1, 2], max_tokens=10,
                                                extra_headers={WORKER_HEADER: dying.instance})
    assert ei.value.status_code == 500 and ei.value.body["type"] == "internal_error"


# --- cancellation --------------------------------------------------------------------------------
async def test_client_disconnect_cancels_worker(deploy: Any) -> None:
    w = await deploy.worker(delay=0.05)
    await deploy.start_frontend()
    await deploy.wait_ready(1)
    import aiohttp
    session = aiohttp.ClientSession()
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 500, "stream": True}
    resp = await session.post(deploy.url + "/v1/completions", json=body)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    await resp.content.readuntil(b"\n\n")
    t_close = time.monotonic()
    resp.close()  # drop the connection mid-stream
    await session.close()
    await until(lambda: len(w.cancelled) == 1, timeout=3.0)
    print(f"disconnect -> worker cancel: {1000 * (w.cancelled_at[0] - t_close):.1f} ms")
    assert not w.completed and len(w.requests) == 1
    await until(lambda: 'vllm_actors_frontend_client_disconnects_total{model="tiny"} 1.0'
                in deploy.frontend.metrics.render().decode(), timeout=2.0)


# --- LoRA --------------------------------------------------------------------------------------
async def test_lora_name_reaches_worker(deploy: Any, bus: Any) -> None:
    w = await deploy.worker()
    loras = Registry(bus.js, bus.subjects.bucket_loras, 10.0)
    await loras.ensure()
    key = f"{w.instance}.tiny-lora"  # what the LoRA actor writes (LoraRecord)
    await loras.put(key, LoraRecord(lora_name="tiny-lora", lora_id=1, path="/x", uri="file:///x",
                                    instance=w.instance, model=MODEL))
    await deploy.start_frontend()
    await deploy.wait_ready(1)
    await until(lambda: "tiny-lora" in deploy.frontend.workers.loras)
    ids = sorted(m.id for m in (await client(deploy).models.list()).data)
    assert ids == ["tiny", "tiny-lora"]
    r = await client(deploy).chat.completions.create(
        model="tiny-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == "tiny-lora" and w.requests[-1].lora_name == "tiny-lora"
    await client(deploy).completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert w.requests[-1].lora_name is None
    await loras.kv.purge(key)
    await until(lambda: "tiny-lora" not in deploy.frontend.workers.loras)
    with pytest.raises(openai.NotFoundError):
        await client(deploy).completions.create(model="tiny-lora", prompt="x", max_tokens=1)


# --- text mode ---------------------------------------------------------------------------------------
async def test_text_mode_when_no_tokenizer(deploy: Any) -> None:
    """A model whose card names no loadable tokenizer: completions go to the worker as text."""
    w = await deploy.worker(model="remote", card_tokenizer="mock")
    await deploy.start_frontend()  # its model section is for "tiny", not "remote"
    await until(lambda: deploy.frontend.workers.models and deploy.frontend.workers.ready_instances())
    c = client(deploy)
    r = await c.completions.create(model="remote", prompt="say it", max_tokens=4, stop=[" w3"])
    assert w.requests[-1].prompt == "say it" and w.requests[-1].token_ids is None
    assert w.requests[-1].sampling.stop == [" w3"]  # text-mode workers also get the stop strings
    assert r.choices[0].text == " w0 w1 w2" and r.choices[0].finish_reason == "stop"
    # chat: the template is applied by the worker (text mode), so the messages go there as they came
    await c.chat.completions.create(model="remote", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    sent = w.requests[-1]
    assert sent.chat is not None and sent.chat.messages == [{"role": "user", "content": "x"}]
    assert sent.token_ids is None and sent.prompt is None


async def test_a_lost_stream_is_resent_to_the_same_live_worker(deploy: Any, text_ids: list[int]) -> None:
    """The only worker is alive but the stream was lost (a bus restart does this): the rest is re-sent
    to that worker at once, not after waiting for 'another' worker to come back."""
    w = await deploy.worker(drop_after=4, delay=0.01)
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir, migration_wait=30))
    await deploy.wait_ready(1)
    t0 = time.monotonic()
    stream = await client(deploy).completions.create(model=MODEL, prompt=[9, 9, 9], max_tokens=12, stream=True)
    text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
    assert time.monotonic() - t0 < 20  # no migration_wait (30 s) spent
    pre = deploy.frontend.app.pipeline.preprocessors.cache.peek((deploy.tiny_dir, None))
    assert text == pre.decode([text_ids[(3 + i) % len(text_ids)] for i in range(12)])
    assert len(w.requests) == 2 and w.requests[-1].sampling.max_tokens == 8  # the rest, same worker


async def test_poison_request_is_quarantined_after_two_deaths(deploy: Any) -> None:
    """Two workers die while serving one request: it fails with a 500 and is not sent a third time;
    the same request is then refused with a 400 without reaching a worker; others are served."""
    first = await deploy.worker(die_after=2, delay=0.01)
    second = await deploy.worker(die_after=2, delay=0.01)
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=deploy.tiny_dir, migration_wait=5))
    await deploy.wait_ready(2)
    poison = {"model": MODEL, "prompt": [7, 7, 7], "max_tokens": 10}
    async with aiohttp.ClientSession() as http:
        async with http.post(deploy.url + "/v1/completions", json=poison) as resp:
            body = await resp.json()
        assert resp.status == 500, body
        assert body["error"]["type"] == "internal_error" and "died while serving it" in body["error"]["message"]
        assert len(first.requests) == 1 and len(second.requests) == 1  # tried on each once, not again
        healthy = await deploy.worker(delay=0.01)
        await deploy.wait_ready(1)
        async with http.post(deploy.url + "/v1/completions", json={**poison, "seed": 5}) as resp:
            body = await resp.json()
        assert resp.status == 400 and "quarantined" in body["error"]["message"], body
        assert not healthy.requests  # refused at the frontend
        async with http.post(deploy.url + "/v1/completions", json={**poison, "prompt": [7, 7, 8]}) as resp:
            assert resp.status == 200, await resp.text()
    metrics = deploy.frontend.metrics.render().decode()
    assert 'vllm_actors_frontend_quarantined_requests_total{model="tiny"} 1.0' in metrics


async def test_one_death_is_retried_once(deploy: Any, text_ids: list[int]) -> None:
    """A worker dying under a request may be a coincidence: the request is retried and completes."""
    await deploy.worker(die_after=3, delay=0.01)
    await deploy.start_frontend()
    await deploy.wait_ready(1)
    healthy = await deploy.worker(delay=0.01)
    await deploy.wait_ready(2)
    r = await client(deploy).completions.create(model=MODEL, prompt=[4, 4], max_tokens=8,
                                                extra_headers={WORKER_HEADER: deploy.workers[0].instance})
    assert r.usage.completion_tokens == 8 and healthy.requests


async def test_request_while_the_bus_is_down_is_a_503_with_retry_after(tmp_path: Any, tiny_dir: str,
                                                                      text_ids: list[int]) -> None:
    """The frontend's nats-server is gone (and stays gone): a request waits at most the stall
    timeout for the reconnect, then gets 503 + Retry-After; it does not hang."""
    srv = EmbeddedNats(port=free_port(), store_dir=str(tmp_path / "js"))
    await srv.start()
    bus = await open_context(srv.url, namespace="busdown", host="testhost", name="test-busdown")
    d = Deployment(bus, tiny_dir, text_ids)
    try:
        await d.worker(delay=0.01)
        await d.start_frontend()  # stall_timeout 1 s
        await d.wait_ready(1)
        assert srv.pid is not None
        os.kill(srv.pid, signal.SIGKILL)
        await until(lambda: not bus.nc.is_connected)
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            async with http.post(d.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": [1, 2], "max_tokens": 4}) as resp:
                body = await resp.json()
            assert time.monotonic() - t0 < 10
        assert resp.status == 503 and resp.headers["Retry-After"], body
        assert "cut off from the bus" in body["error"]["message"]
    finally:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(d.stop(), 10)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(bus.nc.close(), 5)
        await srv.stop(5.0)
