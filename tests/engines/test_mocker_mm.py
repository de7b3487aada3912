"""The mocker's image prompts: its prefix cache keys image blocks by vLLM's image keys, its
``BlockStored`` events carry them as vLLM's do, and a KV router fed those events (through the KV
publisher's translator) finds the same image and misses another."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq
import zmq.asyncio

from actors.engines.kv_events import BlockStored, decode_message
from actors.engines.mocker.config import MockerArgs
from actors.engines.mocker.engine import MockerEngine
from actors.engines.protocol import ImageInput, LoraRef, MultiModalInput, SamplingOptions, TokensPrompt
from actors.kv import hashing
from actors.kv.translate import KvPublisherMetrics, KvTranslator
from actors.router.cost import RouterConfig
from actors.router.kv_router import KvRouter
from actors.worker.contract import GenerateRequest
from actors.worker.validation import build_prompt
from bus.errors import BadRequest
from tests.helpers import subscribed

BS = 8
ARGS = {"speedup_ratio": 0, "block_size": BS, "num_gpu_blocks": 128, "max_model_len": 256,
        "input_modalities": ["text", "image"], "enable_lora": True}
TEXT = [random.Random(0).randrange(3, 30_000) for _ in range(40)]  # expanded prompt: 5 full blocks
IMAGE = (5, 20)  # the image's placeholder range: tokens [5, 25), blocks 0-3
UUID_A, UUID_B, UUID_C = "a" * 64, "b" * 64, "c" * 64


def _mm(uuid: str, placeholder: tuple[int, int] = IMAGE) -> MultiModalInput:
    return MultiModalInput(images=[ImageInput(uuid=uuid, data=b"\x89PNG")], source_ids=TEXT[:8],
                           prompt_len=len(TEXT), placeholders=[placeholder])


async def _run(e: MockerEngine, rid: str, mm: MultiModalInput | None, lora: LoraRef | None = None) -> int:
    """Run one request; its cached tokens."""
    cached = None
    async for o in e.generate(TokensPrompt(TEXT, mm=mm), SamplingOptions(max_tokens=2), rid, lora=lora):
        cached = o.cached_tokens if o.cached_tokens is not None else cached
    assert cached is not None
    return cached


@pytest.fixture(scope="module")
def scenario() -> dict:
    return asyncio.run(_scenario())


async def _scenario() -> dict:
    e = MockerEngine(ARGS)
    await e.start()
    ctx = zmq.asyncio.Context()
    try:
        (src,) = e.kv_event_sources()
        sub = ctx.socket(zmq.SUB)
        sub.connect(src.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        await subscribed(sub, lambda _: e.reset_prefix_cache())  # the empty pool's AllBlocksCleared, dropped
        cached = {
            "a": await _run(e, "a", _mm(UUID_A)),
            "a again": await _run(e, "a2", _mm(UUID_A)),
            "b": await _run(e, "b", _mm(UUID_B)),
            "text": await _run(e, "t", None),
            "a moved": await _run(e, "m", _mm(UUID_A, (6, 20))),
            "a lora": await _run(e, "l", _mm(UUID_A), LoraRef("ad", 1, "/ad")),
        }
        frames = []
        while True:
            try:
                frames.append(await asyncio.wait_for(sub.recv_multipart(), 1.0))
            except TimeoutError:
                break
        sub.close(0)
        return {"cached": cached, "batches": [decode_message(f)[2] for f in frames], "facts": e.facts}
    finally:
        await e.shutdown()
        ctx.term()


def test_same_image_is_cached_and_another_is_not(scenario):
    c = scenario["cached"]
    assert c["a"] == 0
    assert c["a again"] == 32  # 4 full blocks of the 40 (never the last token), as vLLM
    assert c["b"] == 0  # the image starts in block 0: nothing is shared
    assert c["text"] == 0  # same text without the image
    assert c["a moved"] == 0  # same image at another place
    assert c["a lora"] == 0  # same image under a LoRA
    assert scenario["facts"].input_modalities == ["text", "image"]


def test_events_carry_vllms_extra_keys(scenario):
    stored = [ev for b in scenario["batches"] for ev in b.events if isinstance(ev, BlockStored)]
    first = stored[0]
    assert first.parent_block_hash is None and len(first.block_hashes) == 5
    # per block a tuple of items; an image pair is [identifier, offset from the block's start]
    assert first.extra_keys == [([UUID_A, 5],), ([UUID_A, -3],), ([UUID_A, -11],), ([UUID_A, -19],), None]
    lora = next(ev for ev in stored if ev.lora_name == "ad")
    assert lora.extra_keys[:2] == [("ad", [UUID_A, 5]), ("ad", [UUID_A, -3])] and lora.extra_keys[4] == ("ad",)


def test_router_fed_from_the_mocker_finds_the_same_image(scenario):
    tr = KvTranslator("w1", 0, block_size=BS, metrics=KvPublisherMetrics())
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    for batch in scenario["batches"]:
        for ev in tr.translate(batch):
            router.apply_event(ev)
    workers = [("w0", 0), ("w1", 0)]
    span = lambda uuid: [hashing.MmSpan(uuid, *IMAGE)]  # noqa: E731
    hit = router.route(TEXT, workers, mm=span(UUID_A), book=False)
    assert hit.worker == ("w1", 0) and hit.overlap_blocks == 5
    assert router.route(TEXT, workers, mm=span(UUID_C), book=False).overlap_blocks == 0
    assert {c.overlap_blocks for c in router.route(TEXT, workers, mm=span(UUID_C), book=False).costs} == {0}
    assert router.route(TEXT, workers, mm=span(UUID_B), book=False).overlap_blocks == 5  # b ran there too
    assert router.route(TEXT, workers, mm=span(UUID_A), lora_name="ad", book=False).overlap_blocks == 5
    assert router.route(TEXT, workers, mm=span(UUID_C), lora_name="ad", book=False).overlap_blocks == 0


async def test_a_text_mocker_refuses_images():
    e = MockerEngine({k: v for k, v in ARGS.items() if k != "input_modalities"})
    await e.start()
    try:
        assert e.facts.input_modalities == ["text"]
        with pytest.raises(ValueError, match="does not take images"):
            await _run(e, "x", _mm(UUID_A))
        # the worker refuses it before the engine sees it: a 400
        with pytest.raises(BadRequest, match="does not take images"):
            build_prompt(GenerateRequest(token_ids=TEXT, mm=_mm(UUID_A)), e.facts, False)
    finally:
        await e.shutdown()
    img = MockerEngine(ARGS)
    await img.start()
    try:
        prompt, n = build_prompt(GenerateRequest(token_ids=TEXT, mm=_mm(UUID_A)), img.facts, False)
        assert n == 40 and isinstance(prompt, TokensPrompt) and prompt.mm is not None
        with pytest.raises(ValueError, match="placeholder range"):
            await _run(img, "y", _mm(UUID_A, (30, 20)))  # past the prompt's end
    finally:
        await img.shutdown()


def test_input_modalities_arg():
    assert MockerArgs.from_dict({"input_modalities": ["text", "image"]}).input_modalities == ("text", "image")
    for bad in (["image"], ["text", "audio"], "text", [["text"]]):
        with pytest.raises(ValueError, match="input_modalities"):
            MockerArgs.from_dict({"input_modalities": bad})
