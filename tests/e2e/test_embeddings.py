"""/v1/embeddings on the mocker, booted with ``python -m actors.supervisor`` and driven with the
official ``openai`` client: float and base64 vectors of the model's size, equal for equal inputs, in
input order, spread over both embed workers; vLLM's errors as 4xx; the API key, metrics, a client
that leaves (its workers abort), a worker SIGKILLed mid-request (its inputs move to the other), and
a poison input (quarantined after two deaths)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import numpy as np
import pytest
from openai import AuthenticationError, BadRequestError, OpenAI

from tests.e2e.conftest import WORKER_HEADER, Deployment, http_text, post, shutdown
from tests.helpers import registry

MODEL = "tiny-embed"
KEY = "embed-test-key"
HIDDEN = 128  # the tiny model's hidden_size: the mocker's embedding size
POISON = 2047  # a token id whose input SIGKILLs the worker serving it (the vocabulary is 2048)
# at speedup 0.05 a short input takes ~0.35 s of simulated pooling, a 3000-token one ~1.5 s: long
# enough to kill its worker or leave mid-way, and inputs run at once, so a batch costs one input
SETS = ["pools.embed.engine_args.speedup_ratio=0.05", f"pools.embed.engine_args.poison_token_id={POISON}",
        "supervisor.backoff.initial=0.1", "frontend.stall_timeout=3", f"frontend.api_key={KEY}"]
LONG = 3000


def long_input(start: int) -> list[int]:
    """A ``LONG``-token input of ids within the vocabulary (never POISON), distinct per ``start``."""
    return [(start + j) % 1900 + 1 for j in range(LONG)]


@pytest.fixture(scope="class")
def emb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("embed")
    d = Deployment("mocker-embed.toml", tmp, namespace=f"e2eembed{os.getpid()}", sets=SETS, model=MODEL,
                   status_pools={"embed": 2})
    d.start()
    try:
        d.wait_until(lambda: _ready(d), 60, "both embed workers ready")
    except BaseException:
        d.stop(20)
        raise
    yield d
    shutdown(d)


def _ready(d: Deployment) -> bool:
    status, body = d.health()
    return status == 200 and len([i for i in body["instances"] if i["role"] == "embed"]) == 2


def client(d: Deployment, timeout: float = 30) -> OpenAI:
    return OpenAI(base_url=f"{d.url}/v1", api_key=KEY, max_retries=0, timeout=timeout)


def vec(item: Any) -> np.ndarray:
    e = item.embedding
    if isinstance(e, str):
        return np.frombuffer(base64.b64decode(e), dtype="<f4")
    return np.asarray(e, dtype=np.float32)


def raw_post(d: Deployment, body: dict[str, Any]) -> tuple[int, dict[str, str], str]:
    return post(f"{d.url}/v1/embeddings", body, headers={"Authorization": f"Bearer {KEY}"})


def worker_cancellations(d: Deployment) -> float:
    total = 0.0
    for i in range(2):
        for line in http_text(f"http://127.0.0.1:{d.status_ports['embed'] + i}/metrics").splitlines():
            if line.startswith("vllm_actors_worker_cancellations_total{") and 'endpoint="embed"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


class TestMockerEmbeddings:
    def test_float_and_base64_vectors(self, emb: Deployment) -> None:
        c = client(emb)
        texts = ["the sea", "a lighthouse keeper", "the sea", "waves"]
        floats = c.embeddings.create(model=MODEL, input=texts, encoding_format="float")
        b64 = c.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
        assert floats.model == MODEL and floats.object == "list"
        assert [d.index for d in floats.data] == [0, 1, 2, 3]
        fv = [vec(d) for d in floats.data]
        assert all(v.shape == (HIDDEN,) for v in fv)
        assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in fv)  # the pooler normalizes
        assert np.array_equal(fv[0], fv[2])  # equal inputs, equal vectors
        assert not np.array_equal(fv[0], fv[1])
        for v, raw in zip(fv, b64.data, strict=True):
            assert np.array_equal(v, np.frombuffer(base64.b64decode(raw.embedding), dtype="<f4"))
        # input order: each vector is the one its input gets alone
        for t, v in zip(texts, fv, strict=True):
            alone = c.embeddings.create(model=MODEL, input=t, encoding_format="float")
            assert np.array_equal(vec(alone.data[0]), v)
        # the openai client's own default (base64, decoded by the client into floats)
        default = c.embeddings.create(model=MODEL, input=texts)
        assert [np.asarray(d.embedding, dtype=np.float32).tolist() for d in default.data] == [v.tolist() for v in fv]

    def test_bytes_format(self, emb: Deployment) -> None:
        texts = ["the sea", "waves"]
        want = [vec(d) for d in client(emb).embeddings.create(model=MODEL, input=texts, encoding_format="float").data]
        r = httpx.post(f"{emb.url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                       json={"model": MODEL, "input": texts, "encoding_format": "bytes"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/octet-stream")
        meta = json.loads(r.headers["metadata"])
        assert meta["usage"]["prompt_tokens"] > 0 and [d["index"] for d in meta["data"]] == [0, 1]
        for d, w in zip(meta["data"], want, strict=True):
            assert d["shape"] == [HIDDEN] and np.array_equal(np.frombuffer(r.content[d["start"]:d["end"]], "<f4"), w)

    def test_token_inputs_usage_and_truncation(self, emb: Deployment) -> None:
        c = client(emb)
        ids = [[5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9]]
        r = c.embeddings.create(model=MODEL, input=ids, encoding_format="float")
        assert r.usage.prompt_tokens == 12 and r.usage.total_tokens == 12
        v = [vec(d) for d in r.data]
        assert np.array_equal(v[0], v[2]) and not np.array_equal(v[0], v[1])
        one = c.embeddings.create(model=MODEL, input=[5, 6, 7, 8, 9], encoding_format="float")
        assert np.array_equal(vec(one.data[0]), v[0]) and one.usage.prompt_tokens == 5
        # truncate_prompt_tokens keeps the first N (the tokenizer's truncation side, as vllm serve)
        cut = c.embeddings.create(model=MODEL, input=[5, 6, 7, 8, 9], encoding_format="float",
                                  extra_body={"truncate_prompt_tokens": 2})
        first = c.embeddings.create(model=MODEL, input=[5, 6], encoding_format="float")
        assert np.array_equal(vec(cut.data[0]), vec(first.data[0])) and cut.usage.prompt_tokens == 2
        left = c.embeddings.create(model=MODEL, input=[5, 6, 7, 8, 9], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 2, "truncation_side": "left"})
        last = c.embeddings.create(model=MODEL, input=[8, 9], encoding_format="float")
        assert np.array_equal(vec(left.data[0]), vec(last.data[0]))

    def test_chat_inputs_embed_their_rendered_prompt(self, emb: Deployment) -> None:
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sea"}]
        status, _, text = post(f"{emb.url}/tokenize", {"model": MODEL, "messages": chat,
                                                      "add_generation_prompt": False},
                               headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200, text
        ids = json.loads(text)["tokens"]
        c = client(emb)
        want = vec(c.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0])
        one = c.embeddings.create(model=MODEL, input=[], encoding_format="float",  # the client needs an input
                                  extra_body={"messages": chat, "input": None})
        assert np.array_equal(vec(one.data[0]), want) and one.usage.prompt_tokens == len(ids)
        status, _, text = raw_post(emb, {"model": MODEL, "input": [chat, chat[1:]], "encoding_format": "float"})
        assert status == 200, text
        both = json.loads(text)["data"]
        assert np.array_equal(np.asarray(both[0]["embedding"], dtype=np.float32), want)
        assert not np.array_equal(np.asarray(both[1]["embedding"], dtype=np.float32), want)

    def test_inputs_spread_over_both_workers(self, emb: Deployment) -> None:
        c = client(emb)
        raw = c.embeddings.with_raw_response.create(model=MODEL, input=[f"input {i}" for i in range(8)],
                                                    encoding_format="float")
        served = raw.headers[WORKER_HEADER].split(",")
        assert sorted(served) == sorted(emb.instances("embed")), served
        assert len(raw.parse().data) == 8

    def test_bad_input_is_a_4xx_in_openai_shape(self, emb: Deployment) -> None:
        cases: list[tuple[dict[str, Any], int, str]] = [
            ({"model": MODEL, "input": "x", "dimensions": 8}, 400, "does not support Matryoshka"),
            ({"model": MODEL, "input": []}, 400, "at least one prompt"),
            ({"model": MODEL, "input": [1, 999999]}, 400, "out of vocabulary"),
            ({"model": MODEL, "input": [1] * 9000}, 400, "maximum context length"),
            ({"model": MODEL, "input": "x", "truncate_prompt_tokens": 100000}, 400, "truncate_prompt_tokens"),
            ({"model": MODEL, "input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
            ({"model": MODEL, "input": {"a": 1}}, 400, "input"),
            ({"model": MODEL, "input": "x", "normalize": True}, 400, "use_activation"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}, 400,
             "trust_request_chat_template"),
            ({"model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "images"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
              "continue_final_message": True}, 400, "continue_final_message"),
            ({"model": "nope", "input": "x"}, 404, "does not exist"),
        ]
        for body, code, words in cases:
            status, _, text = raw_post(emb, body)
            assert status == code, (body, status, text)
            err = httpx.Response(status, content=text).json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and words in err["message"], (body, err)
        # a generative API on an embedding model is the client's mistake, not a missing worker
        status, _, text = post(f"{emb.url}/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                               headers={"Authorization": f"Bearer {KEY}"})
        assert status == 400 and "does not support Chat Completions API" in text, text
        with pytest.raises(BadRequestError):
            client(emb).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{emb.url}/v1", api_key="wrong", max_retries=0).embeddings.create(model=MODEL, input="x")

    def test_metrics_labelled_by_endpoint(self, emb: Deployment) -> None:
        client(emb).embeddings.create(model=MODEL, input="count me")
        text = http_text(f"{emb.url}/metrics")
        assert f'vllm_actors_frontend_requests_total{{endpoint="embeddings",model="{MODEL}",status="200"}}' in text

    def test_client_leaving_aborts_its_worker_requests(self, emb: Deployment) -> None:
        before = worker_cancellations(emb)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{emb.url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5,
                       json={"model": MODEL, "input": [long_input(0), long_input(1)]})
        emb.wait_until(lambda: worker_cancellations(emb) >= before + 2, 10, "both worker requests aborted")

    def test_worker_killed_mid_request_its_inputs_migrate(self, emb: Deployment) -> None:
        c = client(emb)
        inputs = [long_input(i) for i in range(6)]
        # the same inputs, whole: their vectors (any worker gives the same: one seed, one model)
        want = [vec(d) for d in c.embeddings.create(model=MODEL, input=inputs, encoding_format="float").data]

        async def run() -> tuple[Any, str]:
            req = asyncio.create_task(asyncio.to_thread(
                c.embeddings.with_raw_response.create, model=MODEL, input=inputs, encoding_format="float"))
            await asyncio.sleep(0.5)  # every input is being pooled now
            nc = await nats.connect(emb.bus_url)
            try:
                records = await registry(nc, emb.namespace)
            finally:
                await nc.close()
            victim = sorted(emb.instances("embed"))[0]
            os.kill(int(records[victim]["pid"]), signal.SIGKILL)
            return await req, victim

        t0 = time.monotonic()
        raw, victim = asyncio.run(run())
        got = [vec(d) for d in raw.parse().data]
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        assert victim not in raw.headers[WORKER_HEADER].split(","), raw.headers[WORKER_HEADER]
        assert time.monotonic() - t0 < 20
        line = f'vllm_actors_frontend_model_migration_total{{model="{MODEL}"}} '
        moved = [float(x.split(" ")[-1]) for x in http_text(f"{emb.url}/metrics").splitlines() if x.startswith(line)]
        assert moved and moved[0] >= 1, moved
        emb.wait_until(lambda: _ready(emb) and victim not in emb.instances("embed"), 30, "killed worker replaced")

    def test_poison_input_is_quarantined_after_two_deaths(self, emb: Deployment) -> None:
        body = {"model": MODEL, "input": [[1, 2, POISON]]}
        status, _, text = raw_post(emb, body)
        assert status == 500 and "died while serving it" in text, (status, text)
        status, _, text = raw_post(emb, body)  # identical: refused without reaching a worker
        assert status == 400 and "quarantined" in text, (status, text)
        emb.wait_until(lambda: _ready(emb), 30, "both killed workers replaced")
        ok = client(emb).embeddings.create(model=MODEL, input="still serving", encoding_format="float")
        assert len(ok.data[0].embedding) == HIDDEN
