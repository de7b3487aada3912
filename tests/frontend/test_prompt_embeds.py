"""prompt_embeds on /v1/completions: the one decoding rule (actors.engines.prompt_embeds) that the
frontend and the worker share, and the frontend's handling of them (checked before routing, routed
without KV credit, carried to prefill workers, not resumed after a death) with scripted workers on
real NATS and the official client. vLLM itself: tests/frontend/test_vllm_prompt_embeds.py."""

from __future__ import annotations

import asyncio
import base64
import io
import zipfile
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import openai
import pytest
import torch
from openai import AsyncOpenAI

from actors.engines.limits import LimitError
from actors.engines.prompt_embeds import MAX_EMBEDS_B64, EmbedsTooLarge, b64_cap, decode_embeds
from actors.engines.protocol import EmbedsPrompt, ModelFacts, SamplingOptions
from actors.frontend.responses import PREFILL_HEADER, WORKER_HEADER
from actors.instances.contract import ModelCard
from actors.worker.contract import GenerateChunk, GenerateRequest
from actors.worker.validation import build_prompt
from bus.errors import BadRequest, PayloadTooLarge
from bus.registry import Registry
from tests.frontend.conftest import CONTEXT, MODEL, Deployment, ScriptedWorker
from tests.helpers import eventually, openai_client

HIDDEN = 16


def b64(obj: Any, **save: Any) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf, **save)
    return base64.b64encode(buf.getvalue()).decode()


def rezipped(data: str, compression: int) -> str:
    """The same archive's entries, written with another zip compression."""
    raw = base64.b64decode(data)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", compression=compression) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return base64.b64encode(out.getvalue()).decode()


# --- the rule ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_any_floating_dtype_is_taken_as_sent(dtype: torch.dtype) -> None:
    t = torch.randn(5, HIDDEN).to(dtype)
    out = decode_embeds(b64(t), hidden_size=HIDDEN, max_rows=CONTEXT)
    assert out.dtype == dtype and torch.equal(out, t)  # the engine casts to the model's dtype


def test_a_batch_of_one_is_squeezed_as_vllm_does() -> None:
    t = torch.randn(1, 7, HIDDEN)
    assert torch.equal(decode_embeds(b64(t), hidden_size=HIDDEN), t[0])


BAD: list[tuple[str, str]] = [
    ("not base64!", "not valid base64"),
    (base64.b64encode(b"garbage").decode(), "written by torch.save"),
    (b64(torch.randn(5, HIDDEN), _use_new_zipfile_serialization=False), "written by torch.save"),  # legacy
    (b64({"a": torch.randn(2, HIDDEN)}), "must hold a tensor, got dict"),
    (b64(torch.randn(5, HIDDEN).to_sparse()), "must be a dense tensor"),
    (b64(torch.randn(2, 5, HIDDEN)), "2-D tensor of shape (num_tokens, hidden_size); got shape (2, 5, 16)"),
    (b64(torch.randn(HIDDEN)), "got shape (16,)"),
    (b64(torch.randn(0, HIDDEN)), "has no rows"),
    (b64(torch.randn(5, 8)), "hidden_size 8 does not match the model's hidden_size 16"),
    (b64(torch.ones(5, HIDDEN, dtype=torch.int64)), "dtype torch.int64 is not a floating-point type"),
    (b64(torch.ones(5, HIDDEN, dtype=torch.bool)), "dtype torch.bool is not a floating-point type"),
    # torch's zip reader inflates a deflated entry to the size it declares: a zip bomb's way in
    (rezipped(b64(torch.randn(5, HIDDEN)), zipfile.ZIP_DEFLATED), "compressed entry"),
]
# a view saves its whole storage: refused by its size (413) before a byte is decoded
TOO_LARGE = b64(torch.randn(4096, HIDDEN)[:5])


@pytest.mark.parametrize("data,words", BAD)
def test_bad_embeds_are_refused_with_the_field_named(data: str, words: str) -> None:
    with pytest.raises(LimitError) as ei:
        decode_embeds(data, hidden_size=HIDDEN, max_rows=CONTEXT)
    assert words in str(ei.value) and ei.value.param == "prompt_embeds"


def test_the_size_cap_comes_before_decoding_and_scales_with_the_model() -> None:
    assert b64_cap(None, HIDDEN) == b64_cap(CONTEXT, None) == MAX_EMBEDS_B64
    cap = b64_cap(CONTEXT, HIDDEN)
    assert cap < MAX_EMBEDS_B64
    # the largest tensor the model can take, in the widest dtype, fits under the cap
    assert len(b64(torch.zeros(CONTEXT, HIDDEN, dtype=torch.float64))) <= cap
    with pytest.raises(EmbedsTooLarge, match="too large"):
        decode_embeds("A" * (cap + 4), hidden_size=HIDDEN, max_rows=CONTEXT)  # not decoded: A... is base64
    with pytest.raises(EmbedsTooLarge, match=r"save a copy \(tensor.clone\(\)\)"):
        decode_embeds(TOO_LARGE, hidden_size=HIDDEN, max_rows=CONTEXT)
    with pytest.raises(EmbedsTooLarge):  # whatever the model, within what the bus carries
        decode_embeds("A" * (MAX_EMBEDS_B64 + 4), hidden_size=None)


def test_an_archive_claiming_more_than_it_holds_is_refused() -> None:
    raw = bytearray(base64.b64decode(b64(torch.randn(3, HIDDEN))))
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        info = z.infolist()[0]
    # the central directory's uncompressed size of the first entry, set to 2 GiB
    cd = raw.find(b"PK\x01\x02")
    assert raw[cd + 46:cd + 46 + len(info.filename)].decode() == info.filename
    raw[cd + 24:cd + 28] = (2 << 30).to_bytes(4, "little")
    with pytest.raises(LimitError, match="declares more data than it holds"):
        decode_embeds(base64.b64encode(bytes(raw)).decode(), hidden_size=HIDDEN)


def _facts(**kw: Any) -> ModelFacts:
    return ModelFacts(served_model_name="m", model_path="m", tokenizer_path="m", max_model_len=CONTEXT,
                      block_size=16, total_kv_blocks=64, hidden_size=HIDDEN, **kw)


@pytest.mark.parametrize("data,words", BAD)
def test_the_worker_refuses_what_the_frontend_refuses_in_the_same_words(data: str, words: str) -> None:
    req = GenerateRequest(prompt_embeds=data, sampling=SamplingOptions(max_tokens=1))
    with pytest.raises(BadRequest) as ei:
        build_prompt(req, _facts(), embeds_enabled=True)
    with pytest.raises(LimitError) as rule:
        decode_embeds(data, hidden_size=HIDDEN, max_rows=CONTEXT)
    assert ei.value.message == str(rule.value) and ei.value.param == "prompt_embeds"


def test_the_worker_refuses_a_payload_over_the_cap_as_too_large() -> None:
    req = GenerateRequest(prompt_embeds=TOO_LARGE, sampling=SamplingOptions(max_tokens=1))
    with pytest.raises(PayloadTooLarge) as ei:
        build_prompt(req, _facts(), embeds_enabled=True)
    assert ei.value.code == 413 and ei.value.param == "prompt_embeds"


def test_the_worker_takes_a_batch_of_one_and_counts_rows() -> None:
    req = GenerateRequest(prompt_embeds=b64(torch.randn(1, 9, HIDDEN)), sampling=SamplingOptions(max_tokens=1))
    prompt, n = build_prompt(req, _facts(), embeds_enabled=True)
    assert isinstance(prompt, EmbedsPrompt) and n == 9 and tuple(prompt.tensor.shape) == (9, HIDDEN)
    with pytest.raises(BadRequest, match="not enabled") as ei:
        build_prompt(req, _facts(), embeds_enabled=False)
    assert ei.value.param == "prompt_embeds"


def test_a_card_from_before_the_fields_reads_as_not_enabled() -> None:
    old = b'{"served_model_name":"m","pool":"agg","role":"agg","model_path":"m","tokenizer_path":"m",' \
          b'"context_length":8,"kv_block_size":16,"total_kv_blocks":4}'
    card = msgspec.json.decode(old, type=ModelCard)
    assert (card.hidden_size, card.prompt_embeds) == (None, False)
    new = msgspec.json.decode(msgspec.json.encode(msgspec.structs.replace(card, hidden_size=4096,
                                                                           prompt_embeds=True)), type=ModelCard)
    assert (new.hidden_size, new.prompt_embeds) == (4096, True)


# --- through the frontend ------------------------------------------------------------------------
class EmbedsWorker(ScriptedWorker):
    """A scripted worker whose card says whether its pool takes prompt embeddings (of HIDDEN
    columns), and which reports an embeddings prompt's rows as its prompt tokens, as the engine
    actor does."""

    def __init__(self, *a: Any, embeds: bool = True, hidden: int = HIDDEN, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.embeds = embeds
        self.hidden = hidden

    async def on_start(self) -> None:
        self._cards = Registry(self.bus.js, self.bus.subjects.bucket_models, self.registry_ttl)
        await self._cards.ensure()
        card = ModelCard(served_model_name=self.model, pool=self.pool, role=self.role,
                         model_path=self.tokenizer_path, tokenizer_path=self.tokenizer_path,
                         context_length=CONTEXT, kv_block_size=32, total_kv_blocks=1000,
                         hidden_size=self.hidden, prompt_embeds=self.embeds)
        await self._cards.register(f"{self.model}.{self.pool}", card)

    async def generate(self, req: GenerateRequest, headers: Any) -> AsyncIterator[GenerateChunk]:
        rows = None
        if req.prompt_embeds is not None:
            rows = int(decode_embeds(req.prompt_embeds, hidden_size=self.hidden).shape[0])
        async for chunk in super().generate(req, headers):
            if rows is not None and chunk.num_prompt_tokens is not None:
                chunk.num_prompt_tokens = rows
            if rows is not None and chunk.usage is not None:
                chunk.usage.prompt_tokens = rows
            yield chunk


async def _worker(d: Deployment, **kw: Any) -> EmbedsWorker:
    w = EmbedsWorker(d.bus.child(), tokenizer_path=d.tiny_dir, text_ids=d.text_ids, **kw)
    await w.start()
    d.workers.append(w)
    return w


async def _started(d: Deployment, *workers: dict[str, Any], **frontend: Any) -> list[EmbedsWorker]:
    ws = [await _worker(d, **kw) for kw in workers]
    await d.start_frontend(**frontend)
    await d.wait_ready(len(ws))
    assert d.frontend is not None
    pools = {w.pool for w in ws}
    # the cards come through their own bucket watch: wait for every pool's
    await eventually(lambda: set(d.frontend.workers.models[MODEL].cards) == pools)
    return ws


def client(d: Deployment) -> AsyncOpenAI:
    return openai_client(d.url)


async def test_an_embeddings_prompt_is_sent_as_given_and_counted_by_rows(deploy: Deployment) -> None:
    (w,) = await _started(deploy, {})
    data = b64(torch.randn(6, HIDDEN))
    # the openai client needs a prompt: "" beside prompt_embeds means none, as in vLLM's docs
    r = await client(deploy).completions.create(model=MODEL, prompt="", max_tokens=3,
                                                extra_body={"prompt_embeds": data})
    assert len(r.choices) == 1 and r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 3
    (req,) = w.requests
    assert req.prompt_embeds == data and req.token_ids is None and req.prompt is None
    assert req.sampling.max_tokens == 3 and not req.sampling.detokenize  # the frontend detokenizes
    stream = await client(deploy).completions.create(model=MODEL, prompt="", max_tokens=3, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"prompt_embeds": data})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.prompt_tokens == 6


async def test_several_embeddings_come_before_text_prompts_as_in_vllm(deploy: Deployment) -> None:
    (w,) = await _started(deploy, {})
    first, second = b64(torch.randn(3, HIDDEN)), b64(torch.randn(1, 4, HIDDEN))
    r = await client(deploy).completions.create(model=MODEL, prompt=[[5, 6]], max_tokens=2,
                                                extra_body={"prompt_embeds": [first, second]})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == 3 + 4 + 2
    sent = sorted(w.requests, key=lambda q: q.request_id)  # ids end in the choice index
    assert [(q.prompt_embeds, q.token_ids) for q in sent] == [(first, None), (second, None), (None, [5, 6])]


async def test_max_tokens_defaults_to_the_context_left_after_the_rows(deploy: Deployment) -> None:
    (w,) = await _started(deploy, {})
    body = {"model": MODEL, "prompt_embeds": b64(torch.randn(CONTEXT - 5, HIDDEN))}
    async with __import__("aiohttp").ClientSession() as http:
        async with http.post(deploy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
    assert w.requests[-1].sampling.max_tokens == 5


async def _refused(d: Deployment, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as ei:
        await client(d).completions.create(model=MODEL, prompt=kw.pop("prompt", ""), **kw)
    assert ei.value.status_code == 400
    body = ei.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == 400
    return body


async def test_bad_embeddings_are_400s_before_any_worker_is_asked(deploy: Deployment) -> None:
    (w,) = await _started(deploy, {})
    for data, words in BAD:
        body = await _refused(deploy, max_tokens=2, extra_body={"prompt_embeds": data})
        assert words in body["message"] and body["param"] == "prompt_embeds", body
    body = await _refused(deploy, max_tokens=2, extra_body={"prompt_embeds": [b64(torch.randn(2, HIDDEN)),
                                                                                "%%"]})
    assert "(prompt_embeds[1])" in body["message"]
    with pytest.raises(openai.APIStatusError) as ei:
        await client(deploy).completions.create(model=MODEL, prompt="", max_tokens=2,
                                                extra_body={"prompt_embeds": TOO_LARGE})
    assert ei.value.status_code == 413 and "too large" in ei.value.body["message"]
    assert ei.value.body["param"] == "prompt_embeds"
    # rows count as prompt tokens against the context, in vLLM's words
    body = await _refused(deploy, max_tokens=10, extra_body={"prompt_embeds": b64(torch.randn(CONTEXT - 5, HIDDEN))})
    assert body["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens")
    body = await _refused(deploy, max_tokens=2, echo=True, extra_body={"prompt_embeds": b64(torch.randn(2, HIDDEN))})
    assert body["message"] == "Echo is unsupported with prompt embeds."
    body = await _refused(deploy, max_tokens=2, extra_body={"prompt_embeds": b64(torch.randn(2, HIDDEN)),
                                                            "prompt_logprobs": 1})
    assert body["param"] == "prompt_logprobs"
    assert not w.requests


async def test_embeddings_beyond_what_the_bus_carries_are_a_413_not_a_500(deploy: Deployment) -> None:
    """A wide model's context allows more than one bus message holds: the cap is the bus's then."""
    (w,) = await _started(deploy, {"hidden": 8192}, max_body_bytes=64 << 20)
    data = b64(torch.randn(600, 8192).half())  # 9.8 MB of fp16, 13 MB of base64
    assert len(data) > MAX_EMBEDS_B64
    with pytest.raises(openai.APIStatusError) as ei:
        await client(deploy).completions.create(model=MODEL, prompt="", max_tokens=2,
                                                extra_body={"prompt_embeds": data})
    assert ei.value.status_code == 413 and f"at most {MAX_EMBEDS_B64}" in ei.value.body["message"]
    r = await client(deploy).completions.create(model=MODEL, prompt="", max_tokens=2,
                                                extra_body={"prompt_embeds": b64(torch.randn(200, 8192).half())})
    assert r.usage.prompt_tokens == 200 and len(w.requests) == 1


async def test_a_pool_without_prompt_embeds_is_named(deploy: Deployment) -> None:
    await _started(deploy, {"embeds": False}, {"pool": "b"})  # a second agg pool that takes them: not enough
    body = await _refused(deploy, max_tokens=2, extra_body={"prompt_embeds": b64(torch.randn(2, HIDDEN))})
    assert "pools.agg.prompt_embeds = true" in body["message"] and "pools.b." not in body["message"]
    assert body["param"] == "prompt_embeds"
    assert not any(w.requests for w in deploy.workers)


async def test_kv_routing_gives_embeddings_no_credit_and_books_nothing(deploy: Deployment) -> None:
    """No token ids: the kv router has nothing to hash, so it neither credits a prefix nor books
    predicted blocks (a later token prompt can never hit on them); token prompts still book."""
    await _started(deploy, {}, {}, router="kv", kv_events=False)
    policy = deploy.frontend._router
    await eventually(lambda: policy.router is not None)
    c = client(deploy)
    served = set()
    for _ in range(4):
        raw = await c.completions.with_raw_response.create(
            model=MODEL, prompt="", max_tokens=2, extra_body={"prompt_embeds": b64(torch.randn(70, HIDDEN))})
        served.add(raw.headers[WORKER_HEADER])
    assert len(served) == 2  # spread like round robin, not pulled to one "cached" worker
    assert policy.router.index.stats()["blocks"] == 0
    await c.completions.create(model=MODEL, prompt=list(range(1, 71)), max_tokens=2)
    assert policy.router.index.stats()["blocks"] == 2  # 70 tokens: two full blocks of 32 booked


async def test_the_prefill_worker_gets_the_embeddings_too(deploy: Deployment) -> None:
    prefill, decode = await _started(deploy, {"role": "prefill", "pool": "prefill"},
                                     {"role": "decode", "pool": "decode"})
    data = b64(torch.randn(5, HIDDEN))
    raw = await client(deploy).completions.with_raw_response.create(model=MODEL, prompt="", max_tokens=3,
                                                                    extra_body={"prompt_embeds": data})
    assert raw.headers[PREFILL_HEADER] == prefill.instance and raw.headers[WORKER_HEADER] == decode.instance
    (preq,), (dreq,) = prefill.requests, decode.requests
    assert preq.prompt_embeds == dreq.prompt_embeds == data and preq.sampling.max_tokens == 1
    assert dreq.prefill_result is not None and raw.parse().usage.prompt_tokens == 5


async def test_a_death_before_any_token_migrates_the_embeddings(deploy: Deployment) -> None:
    dying, healthy = await _started(deploy, {"die_after": 0}, {})
    data = b64(torch.randn(4, HIDDEN))
    r = await client(deploy).completions.create(model=MODEL, prompt="", max_tokens=3,
                                                extra_body={"prompt_embeds": data},
                                                extra_headers={WORKER_HEADER: dying.instance})
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens == 4
    assert healthy.requests[-1].prompt_embeds == data and healthy.requests[-1].token_ids is None


async def test_a_death_after_tokens_is_a_503_not_a_resume(deploy: Deployment) -> None:
    """The produced tokens cannot be appended to an embeddings prompt: the client sends it again."""
    dying, healthy = await _started(deploy, {"die_after": 2, "delay": 0.01}, {})
    with pytest.raises(openai.APIStatusError) as ei:
        await asyncio.wait_for(client(deploy).completions.create(
            model=MODEL, prompt="", max_tokens=8, extra_body={"prompt_embeds": b64(torch.randn(4, HIDDEN))},
            extra_headers={WORKER_HEADER: dying.instance}), 20)
    assert ei.value.status_code == 503 and "send the request again" in ei.value.body["message"]
    assert not healthy.requests
