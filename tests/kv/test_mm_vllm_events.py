"""Image blocks against vLLM itself (vLLM-CPU 0.32): its extra-key functions, and the KV events of a
real engine running the tiny VLM. The router hashes the KV publisher derives from vLLM's events must
equal what the frontend computes for the expanded prompt and vLLM's placeholder ranges."""

from __future__ import annotations

import asyncio
import hashlib
import io
import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engines import kv_events as ve
from actors.engines.protocol import ImageInput, MultiModalInput
from actors.kv import hashing
from actors.kv.hashing import MmSpan
from actors.kv.translate import KvPublisherMetrics, KvTranslator
from tests.helpers import subscribed

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

BS = 32  # vLLM-CPU's block size
PROMPT = "<|begin_of_text|><|im_start|>user\n<image>Compare with<image>What is this?<|im_end|>\n<|im_start|>assistant\n"
LONGER = ("<|begin_of_text|><|im_start|>user\n<image>Compare with<image>What is this? Tell me more about the two "
          "pictures please, in many words.<|im_end|>\n<|im_start|>assistant\n")


def _seqs(events) -> list[int]:
    return [b.seq_hash for e in events for b in e.stored]


def _wire(*events: ve.BlockStored) -> ve.KVEventBatch:
    return ve.decode_batch(ve.encode_batch(ve.KVEventBatch(ts=1.0, events=list(events))))


def _vllm_event_keys(n_tokens: int, block_size: int, spans: list[MmSpan], lora: str | None,
                     salt: str | None) -> list[Any]:
    """A prompt's per-block ``BlockStored.extra_keys``, made by vLLM's own functions."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    from vllm.v1.request import Request

    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=sp.identifier,
                                   mm_position=PlaceholderRange(offset=sp.offset, length=sp.length))
             for sp in spans]
    req = Request("r", list(range(n_tokens)), SamplingParams(max_tokens=1), None, mm_features=feats,
                  lora_request=LoRARequest(lora, 1, "/adapter") if lora else None, cache_salt=salt)
    keys, idx = [], 0
    for b in range(n_tokens // block_size):
        k, idx = generate_block_hash_extra_keys(req, b * block_size, (b + 1) * block_size, idx)
        keys.append(k)
    return to_event_extra_keys(keys) or []


@pytest.mark.parametrize("lora, salt", [(None, None), ("ad", None), (None, "s1"), ("ad", "s1")])
def test_vllms_own_extra_keys_translate_to_the_frontend_hashes(lora, salt):
    toks = [random.Random(7).randrange(50_000) for _ in range(5 * 8)]
    spans = [MmSpan("a" * 64, 5, 10), MmSpan("b" * 64, 15, 12)]
    extra = _vllm_event_keys(len(toks), 8, spans, lora, salt)
    t = KvTranslator("w", 0, block_size=8, metrics=KvPublisherMetrics())
    lid = 1 if lora else None
    first = t.translate(_wire(ve.stored([1, 2], toks[:16], 8, lora_name=lora, lora_id=lid, extra_keys=extra[:2])))
    cont = t.translate(_wire(ve.stored([3, 4, 5], toks[16:], 8, parent_block_hash=2, lora_name=lora,
                                       lora_id=lid, extra_keys=extra[2:])))
    assert _seqs(first) + _seqs(cont) == hashing.sequence_hashes(toks, 8, lora, salt, spans)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 30)), max_size=5), st.integers(1, 16))
def test_block_keys_equal_vllms(gaps_lengths, bs):
    spans, pos = [], 0
    for i, (gap, n) in enumerate(gaps_lengths):
        spans.append(MmSpan(f"img{i}", pos + gap, n))
        pos += gap + n
    n_blocks = pos // bs + 1
    theirs = _vllm_event_keys(n_blocks * bs, bs, spans, None, None)
    ours = hashing.mm_block_keys(spans, bs, n_blocks)
    assert [k or None for k in ours] == theirs


# ---- a real engine ---------------------------------------------------------------------------------
def _png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


class Vlm:
    """vLLM's LLM on the tiny VLM with ZMQ KV events, vLLM's processor (as the frontend expands
    prompts), and a SUB socket on the events."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        from vllm import LLM
        from vllm.config import KVEventsConfig, ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        from actors.engines.vllm_args import applied_env, default_env
        from actors.models.tiny_vlm import ensure_tiny_vlm

        path = str(ensure_tiny_vlm())
        # Subscribe before vLLM binds (ZMQ reconnects until it does): the subscription travels as
        # soon as vLLM's PUB is bound, during the engine start, not only once LLM() has returned.
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        with applied_env(default_env(True)):
            self.llm = LLM(model=path, enforce_eager=True, block_size=BS, max_model_len=1024,
                           enable_prefix_caching=True, kv_cache_memory_bytes=128 << 20,
                           limit_mm_per_prompt={"image": 2},
                           kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                           endpoint=endpoint))
        self.tok = self.llm.get_tokenizer()
        self.proc = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=path, max_model_len=1024))

    def expand(self, text: str, images: list[bytes]) -> tuple[list[int], MultiModalInput]:
        """What the frontend does: the rendered ids expanded by vLLM's processor, and the ranges."""
        from PIL import Image
        from vllm.multimodal.processing.context import TimingContext
        from vllm.multimodal.processing.inputs import ProcessorInputs

        ids = self.tok.encode(text, add_special_tokens=False)
        uuids = [hashlib.sha256(d).hexdigest() for d in images]
        out = self.proc.apply(ProcessorInputs(
            prompt=ids, mm_data_items=self.proc.info.parse_mm_data(
                {"image": [Image.open(io.BytesIO(d)) for d in images]}),
            mm_uuid_items={"image": uuids}), TimingContext(enabled=False))
        expanded = list(out["prompt_token_ids"])
        mm = MultiModalInput(images=[ImageInput(uuid=u, data=d) for u, d in zip(uuids, images, strict=True)],
                             source_ids=ids, prompt_len=len(expanded),
                             placeholders=[(r.offset, r.length) for r in out["mm_placeholders"]["image"]])
        return expanded, mm

    def run(self, expanded: list[int], mm: MultiModalInput) -> tuple[int, list[ve.KVEventBatch]]:
        """Run the prompt as our engine hands it to vLLM (vllm_io.mm_prompt); cached tokens, events."""
        from vllm import SamplingParams

        from actors.engines.vllm_io import mm_prompt

        out = self.llm.generate(mm_prompt(expanded, mm), SamplingParams(max_tokens=2, temperature=0),
                                use_tqdm=False)[0]
        assert list(out.prompt_token_ids) == expanded  # the engine expands as the frontend did
        batches = []
        while self.sub.poll(500):
            batches.append(ve.decode_message(self.sub.recv_multipart())[2])
        return out.num_cached_tokens, batches

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()
        self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vlm]:
    import time

    v = Vlm(f"ipc://{tmp_path_factory.mktemp('kv')}/events")  # vLLM binds an ipc endpoint
    time.sleep(0.5)  # the SUB reconnects every 0.1 s: one more round after vLLM bound, at least
    try:
        yield v
    finally:
        v.close()


def test_engine_events_hash_like_the_frontend(vlm: Vlm):
    t = KvTranslator("w", 0, block_size=BS, metrics=KvPublisherMetrics())
    runs: list[tuple[list[int], MultiModalInput, int, list[ve.BlockStored]]] = []

    def run(ids: list[int], mm: MultiModalInput) -> tuple[int, list[int]]:
        cached, batches = vlm.run(ids, mm)
        runs.append((ids, mm, cached, [e for b in batches for e in b.events if isinstance(e, ve.BlockStored)]))
        return cached, _seqs(e for b in batches for e in t.translate(b))

    ab = [_png(1), _png(2)]
    ids, mm = vlm.expand(PROMPT, ab)
    assert len(ids) >= 2 * BS and mm.placeholders[0][0] + mm.placeholders[0][1] > BS  # an image spans blocks
    cached, got = run(ids, mm)
    assert cached == 0
    assert any(isinstance(k, tuple) and any(isinstance(i, list) and i[1] < 0 for i in k)
               for k in runs[0][3][0].extra_keys or [])  # vLLM's negative offsets, as 2-lists
    want = hashing.sequence_hashes(ids, BS, mm=hashing.mm_spans(mm))
    assert got == want

    # a longer prompt with the same images: vLLM stores only the new blocks, as a continuation
    ids2, mm2 = vlm.expand(LONGER, ab)
    cached, got = run(ids2, mm2)
    assert cached > 0 and runs[-1][3] and runs[-1][3][0].parent_block_hash is not None
    assert got == hashing.sequence_hashes(ids2, BS, mm=hashing.mm_spans(mm2))[cached // BS:]

    # the same text with other images: vLLM misses, and so do the router hashes
    ids3, mm3 = vlm.expand(PROMPT, [_png(3), _png(4)])
    assert ids3 == ids
    cached, got = run(ids3, mm3)
    assert cached == 0
    assert got == hashing.sequence_hashes(ids3, BS, mm=hashing.mm_spans(mm3))
    assert not set(got) & set(want)

    # and the first prompt again: vLLM hits its blocks, the router would too
    cached, _ = run(ids, mm)
    assert cached == BS * ((len(ids) - 1) // BS)

    # the mocker, given the same prompts, caches and publishes exactly as vLLM did
    mocked = asyncio.run(_mocker_runs([(i, m) for i, m, _, _ in runs]))
    for (_, _, cached, real), (m_cached, mock) in zip(runs, mocked, strict=True):
        assert m_cached == cached
        assert [(e.extra_keys, e.token_ids, e.parent_block_hash is None) for e in mock] == \
            [(e.extra_keys, e.token_ids, e.parent_block_hash is None) for e in real]


async def _mocker_runs(prompts: list[tuple[list[int], MultiModalInput]]) -> list[tuple[int, list[ve.BlockStored]]]:
    import zmq
    import zmq.asyncio

    from actors.engines.mocker.engine import MockerEngine
    from actors.engines.protocol import SamplingOptions, TokensPrompt

    e = MockerEngine({"speedup_ratio": 0, "block_size": BS, "num_gpu_blocks": 64, "max_model_len": 1024,
                      "input_modalities": ["text", "image"]})
    await e.start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        (src,) = e.kv_event_sources()
        sub.connect(src.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await subscribed(sub, lambda _: e.reset_prefix_cache())  # the empty pool's AllBlocksCleared, dropped
        out = []
        for n, (ids, mm) in enumerate(prompts):
            cached = 0
            async for o in e.generate(TokensPrompt(ids, mm=mm), SamplingOptions(max_tokens=2), f"r{n}"):
                cached = o.cached_tokens if o.cached_tokens is not None else cached
            events: list[ve.BlockStored] = []
            while await sub.poll(300):
                batch = ve.decode_message(await sub.recv_multipart())[2]
                events += [ev for ev in batch.events if isinstance(ev, ve.BlockStored)]
            out.append((cached, events))
        return out
    finally:
        sub.close(0)
        ctx.term()
        await e.shutdown()
