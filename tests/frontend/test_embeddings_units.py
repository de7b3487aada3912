"""/v1/embeddings without a bus: the mocker's embeddings (Matryoshka ``dimensions``, activation,
abort, death) and the frontend's plan and response against model cards (an embedding model, a
generative one, a Matryoshka one), with vLLM's own checks and encoders as the reference."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
import pytest
import torch
from vllm.entrypoints.pooling.utils import MetadataItem, decode_pooling_output
from vllm.utils.serial_utils import tensor2binary

from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import EncodeFailed, EngineDeadError
from actors.frontend.discovery import ModelEntry
from actors.frontend.embedding_io import (
    EmbedPlan,
    binary_response,
    parse_embedding,
    plan_embedding,
    shape_response,
)
from actors.frontend.preprocess import Preprocessor
from actors.instances.contract import ModelCard
from actors.models.tiny import resolve_model_path
from actors.worker.contract import EmbedReply
from bus.errors import BadRequest

ARGS = {"speedup_ratio": 0, "block_size": 4, "num_gpu_blocks": 256, "max_model_len": 256, "vocab_size": 2048,
        "embedding_size": 32}


async def _engine(**kw: Any) -> MockerEngine:
    e = MockerEngine({**ARGS, **kw}, role="embed", served_model_name="m")
    await e.start()
    return e


def _f32(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<f4")


async def test_mocker_embeddings_are_deterministic_normalized_and_matryoshka() -> None:
    e = await _engine(matryoshka_dimensions=[8, 16])
    try:
        a, b, c = [_f32(await e.embed(ids, f"r{i}")) for i, ids in enumerate([[1, 2, 3], [1, 2, 3], [1, 2, 4]])]
        assert a.shape == (32,) and np.array_equal(a, b) and not np.array_equal(a, c)
        assert abs(float(np.linalg.norm(a)) - 1) < 1e-6
        raw = _f32(await e.embed([1, 2, 3], "raw", use_activation=False))
        assert abs(float(np.linalg.norm(raw)) - 1) > 1e-3  # no activation: not normalized
        cut = _f32(await e.embed([1, 2, 3], "cut", dimensions=8))
        # Matryoshka: the first dimensions, normalized again (as vLLM's pooler does)
        assert np.allclose(cut, raw[:8] / np.linalg.norm(raw[:8]), atol=1e-6)
        with pytest.raises(ValueError, match=r"only supports Matryoshka dimensions \[8, 16\], got 9"):
            await e.embed([1], "bad", dimensions=9)
        with pytest.raises(ValueError, match="out of vocabulary"):
            await e.embed([4096], "oov")
    finally:
        await e.shutdown()


async def test_mocker_embedding_abort_and_death() -> None:
    e = await _engine(speedup_ratio=0.001)  # a 3-token prompt: ~17 s of simulated pooling
    try:
        run = asyncio.ensure_future(e.embed([1, 2, 3], "slow"))
        await asyncio.sleep(0.05)
        await e.abort("slow")
        with pytest.raises(EncodeFailed):
            await asyncio.wait_for(run, 2)
        run = asyncio.ensure_future(e.embed([1, 2, 3], "doomed"))
        await asyncio.sleep(0.05)
        e.inject_death()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(run, 2)
    finally:
        await e.shutdown()


async def test_mocker_refuses_dimensions_without_matryoshka() -> None:
    e = await _engine()
    try:
        with pytest.raises(ValueError, match="does not support Matryoshka embeddings"):
            await e.embed([1], "d", dimensions=4)
    finally:
        await e.shutdown()


def _card(role: str, **kw: Any) -> ModelCard:
    return ModelCard(served_model_name="m", pool=role, role=role, model_path="/x", tokenizer_path="/x",
                     context_length=64, kv_block_size=16, total_kv_blocks=100, vocab_size=2048, **kw)


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor(resolve_model_path("tiny"))


def test_plan_checks_as_vllm_serve(pre: Preprocessor) -> None:
    embed = ModelEntry("m", {"embed": _card("embed", embedding_size=32)})
    plan = plan_embedding(parse_embedding(b'{"input": ["hello", "hello"]}'), embed, "m", pre)
    assert plan.prompts[0] == plan.prompts[1] == pre.encode("hello", True)
    plan = plan_embedding(parse_embedding(b'{"input": [5, 6, 7], "truncate_prompt_tokens": 2}'), embed, "m", pre)
    assert plan.prompts == [[5, 6]]
    cases = {b'{"input": "x", "dimensions": 4}': "does not support Matryoshka",
             b'{"input": [1, 2], "truncate_prompt_tokens": 65}': "cannot be greater than max_model_len",
             b'{"input": [[1]], "encoding_format": "hex"}': "encoding_format",
             b'{"input": []}': "at least one prompt",
             b'{"input": [1, 2048]}': "out of vocabulary",
             b'{"input": [' + b"[1]," * 2048 + b'[1]]}': "at most 2048"}
    for body, words in cases.items():
        with pytest.raises(BadRequest, match=words):
            plan_embedding(parse_embedding(body), embed, "m", pre)
    with pytest.raises(BadRequest, match="maximum context length is 64"):
        plan_embedding(parse_embedding(b'{"input": [' + b"1," * 64 + b'1]}'), embed, "m", pre)  # 65 tokens
    # a generative model: the embeddings API is not its
    agg = ModelEntry("m", {"agg": _card("agg")})
    with pytest.raises(BadRequest, match="does not support Embeddings API"):
        plan_embedding(parse_embedding(b'{"input": "x"}'), agg, "m", pre)
    # Matryoshka: only the dimensions the card names
    mat = ModelEntry("m", {"embed": _card("embed", embedding_size=32, is_matryoshka=True,
                                          matryoshka_dimensions=[8, 16])})
    assert plan_embedding(parse_embedding(b'{"input": "x", "dimensions": 8}'), mat, "m", pre).dimensions == 8
    with pytest.raises(BadRequest, match=r"only supports Matryoshka dimensions \[8, 16\], got 9"):
        plan_embedding(parse_embedding(b'{"input": "x", "dimensions": 9}'), mat, "m", pre)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("endianness", ["native", "big", "little"])
def test_base64_is_vllms_encoding(dtype: str, endianness: str) -> None:
    vec = np.random.default_rng(0).standard_normal(16).astype("<f4")
    entry = ModelEntry("m", {"embed": _card("embed", embedding_size=16)})
    plan = EmbedPlan(entry=entry, model="m", prompts=[[1]], dimensions=None, use_activation=None,
                     encoding_format="base64", embed_dtype=dtype, endianness=endianness)
    body = shape_response(plan, [EmbedReply(embedding=vec.tobytes(), prompt_tokens=1)], created=1)
    want = base64.b64encode(tensor2binary(torch.from_numpy(vec.copy()), dtype, endianness)).decode()  # type: ignore[arg-type]
    assert body["data"][0]["embedding"] == want
    assert body["usage"] == {"prompt_tokens": 1, "total_tokens": 1, "completion_tokens": 0,
                             "prompt_tokens_details": None}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_are_vllms_layout(dtype: str) -> None:
    rng = np.random.default_rng(1)
    vecs = [rng.standard_normal(16).astype("<f4") for _ in range(3)]
    entry = ModelEntry("m", {"embed": _card("embed", embedding_size=16)})
    plan = EmbedPlan(entry=entry, model="m", prompts=[[1], [2], [3]], dimensions=None, use_activation=None,
                     encoding_format="bytes", embed_dtype=dtype, endianness="big")
    body, headers = binary_response(plan, [EmbedReply(embedding=v.tobytes(), prompt_tokens=2) for v in vecs])
    meta = json.loads(headers["metadata"])
    assert meta["usage"] == {"prompt_tokens": 6, "total_tokens": 6} and meta["model"] == "m"
    got = decode_pooling_output([MetadataItem(**{**d, "shape": tuple(d["shape"])}) for d in meta["data"]], body)
    for v, t in zip(vecs, got, strict=True):  # vLLM's own decoder reads them back
        assert torch.allclose(t.float(), torch.from_numpy(v), atol=1e-2)
    plan.encoding_format = "bytes_only"
    only, no_headers = binary_response(plan, [EmbedReply(embedding=v.tobytes(), prompt_tokens=2) for v in vecs])
    assert only == body and no_headers == {}


def test_chat_inputs_are_rendered_as_a_chat_prompt(pre: Preprocessor) -> None:
    embed = ModelEntry("m", {"embed": _card("embed", embedding_size=32)})
    chat = [{"role": "user", "content": "the sea"}]
    want = pre.encode(pre.render_chat(chat, add_generation_prompt=False), False)
    one = plan_embedding(parse_embedding(json.dumps({"messages": chat}).encode()), embed, "m", pre)
    assert one.prompts == [want]
    two = plan_embedding(parse_embedding(json.dumps({"input": [chat, chat]}).encode()), embed, "m", pre)
    assert two.prompts == [want, want]
    own = json.dumps({"messages": chat, "chat_template": "{{ messages[0]['content'] }}"}).encode()
    with pytest.raises(BadRequest, match="trust_request_chat_template"):
        plan_embedding(parse_embedding(own), embed, "m", pre)
    assert plan_embedding(parse_embedding(own), embed, "m", pre, True).prompts == [pre.encode("the sea", False)]


class _Link:
    """The bus side of the embedding service, as a fake: only liveness is asked here."""

    def __init__(self, verdict: Any) -> None:
        self.verdict = verdict

    async def liveness(self, worker: Any) -> Any:
        return self.verdict


def _service(link: _Link) -> tuple[Any, Any]:
    from actors.frontend.discovery import WorkerSet
    from actors.frontend.embeddings import EmbeddingService
    from actors.frontend.metrics import FrontendMetrics
    from actors.frontend.quarantine import Quarantine
    from actors.instances.contract import InstanceRecord
    from config.topology import FrontendConfig

    ws = WorkerSet()
    ws.put_model("m.embed", _card("embed"))
    ws.put_instance("e0", InstanceRecord(instance="e0", kind="engine", role="embed", model="m", host="h", pid=1,
                                         pool="embed", generate_subject="ns.embed.e0", started_at=1.0))
    svc = EmbeddingService(workers=ws, link=link, config=FrontendConfig(), metrics=FrontendMetrics(),  # type: ignore[arg-type]
                           preprocessors=None, quarantine=Quarantine())  # type: ignore[arg-type]
    return svc, ws


async def test_an_input_whose_only_worker_still_runs_is_not_held_for_another() -> None:
    """The only embedding worker timed out on an input (its answer lost in a bus restart) but still
    runs: no other worker can come, so the input gets 503 + Retry-After at once, not after
    migration_wait. One that died is waited for, and served by its restarted incarnation."""
    import time

    from actors.frontend.embeddings import _Input
    from actors.frontend.worker_link import Liveness
    from actors.instances.contract import InstanceRecord
    from bus.errors import Overloaded, RequestTimeout

    svc, ws = _service(_Link(Liveness.ALIVE))
    (worker,) = ws.workers("m", "embed")
    inp = _Input(index=0, ids=[1, 2, 3])
    assert await svc._judge(worker, RequestTimeout("no reply"), inp) is False
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as e:
        await svc._choose("m", inp, None, wait=60.0)
    assert time.monotonic() - t0 < 1.0 and e.value.code == 503 and "still run" in str(e.value)

    svc, ws = _service(_Link(Liveness.DEAD))
    (worker,) = ws.workers("m", "embed")
    inp = _Input(index=0, ids=[1, 2, 3])
    assert await svc._judge(worker, RequestTimeout("no reply"), inp) is True

    async def restart() -> None:
        await asyncio.sleep(0.3)
        ws.put_instance("e0", InstanceRecord(instance="e0", kind="engine", role="embed", model="m", host="h", pid=2,
                                             pool="embed", generate_subject="ns.embed.e0", started_at=2.0))

    task = asyncio.create_task(restart())
    chosen = await svc._choose("m", inp, None, wait=10.0)
    await task
    assert chosen.instance == "e0" and chosen.started_at == 2.0
