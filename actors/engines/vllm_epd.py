"""E/P/D with vLLM's encoder-cache connector: a VllmEngine's two parts in it.

``EncodeSide`` is an encode engine's (``ec_producer``): it runs the vision encoder on a request's
images and reads back the file the connector wrote for each, keeping recent ones for repeated
images. ``ConsumeSide`` is an agg or prefill engine's (``ec_consumer``): it checks the encoder
outputs a request carries and writes them where its connector loads them from, instead of
encoding those images. The files themselves (names, checks, staging) are ec_staging.py's; the
engine's lifecycle and its other requests stay in vllm_engine.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec

from actors.engines.ec_staging import (
    ConsumerStaging,
    OutputCache,
    check_name,
    check_output,
    drop_output,
    take_output,
)
from actors.engines.protocol import (
    EncodeFailed,
    EngineOutput,
    ImageInput,
    MultiModalInput,
    Prompt,
    SamplingOptions,
    TokensPrompt,
)

# An encode request runs the encoder and stops: vLLM's encode-only engine finishes it with no token.
_ENCODE_SAMPLING = SamplingOptions(max_tokens=1, temperature=0.0, detokenize=False)
# encoder outputs an encode engine keeps for repeated images (bytes; the tiny VLM's are 5 KiB, a
# 7B VLM's 1-7 MiB per image)
ENCODE_CACHE_BYTES = 256 << 20
# a cancelled encode's directory may still be written by the engine step in flight: swept later
_ORPHAN_TTL_S = 60.0
# safetensors dtype names of the model dtypes vLLM runs (a consumer's outputs must match it)
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}

Generate = Callable[[Prompt, SamplingOptions, str], AsyncIterator[EngineOutput]]


class ConsumeSide:
    """An ec_consumer engine's staging of the encoder outputs its requests carry."""

    def __init__(self, root: Path, hidden_size: int, model_dtype: str) -> None:
        """``model_dtype``: the engine's torch dtype name ("bfloat16"); outputs of another are refused."""
        self._staging = ConsumerStaging(root)
        self._hidden_size = hidden_size
        self._dtype = _SAFETENSORS_DTYPES.get(model_dtype)

    def stage(self, prompt: Prompt) -> list[str]:
        """Write the encoder outputs ``prompt`` carries where the connector looks for them, checked
        first (vLLM loads them unchecked, inside an engine step: a bad one would kill the engine).
        Returns the ids staged, for ``unstage``. Images without an output are encoded by the
        engine itself, which gives the same result."""
        mm = prompt.mm if isinstance(prompt, TokensPrompt) else None
        if mm is None:
            return []
        given = [(img, length) for img, (_off, length) in zip(mm.images, mm.placeholders, strict=False)
                 if img.encoder_output is not None]
        for img, length in given:
            check_name(img.uuid)
            check_output(img.encoder_output or b"", max_rows=length, width_unit=self._hidden_size,
                         dtype=self._dtype)
        staged: list[str] = []
        try:
            for img, _length in given:
                self._staging.stage(img.uuid, img.encoder_output or b"")
                staged.append(img.uuid)
        except OSError:
            self.unstage(prompt, staged)
            raise
        return staged

    def unstage(self, prompt: Prompt, staged: list[str]) -> None:
        """The request is over: its staged outputs are released, and files of its images no other
        request holds are removed."""
        if not isinstance(prompt, TokensPrompt) or prompt.mm is None:
            return
        for uuid in staged:
            self._staging.release(uuid)
        self._staging.sweep([img.uuid for img in prompt.mm.images])


class EncodeSide:
    """An ec_producer engine's encode requests: run, read back, cache."""

    def __init__(self, root: Path, cache_bytes: int = ENCODE_CACHE_BYTES) -> None:
        self._root = root
        self._outputs = OutputCache(cache_bytes)  # recent outputs by image id
        self._orphans: dict[str, float] = {}  # names of cancelled runs -> when
        self._probe: tuple[list[int], MultiModalInput] | None = None

    async def encode(self, generate: Generate, mm: MultiModalInput, token_ids: list[int], request_id: str, *,
                     cached: bool = True) -> list[tuple[str, bytes]]:
        """Run the encoder on the images (vLLM's encode-only engine stops each request after it) and
        read back the file its connector wrote for each: ``(image id, bytes)`` in first-seen order.

        Each run names its images ``<id>-<nonce>``: vLLM skips the encoder for an image already in
        its encoder cache and then writes no file, so a name it has never seen is what makes it
        write one every time. Repeats are served from the ``OutputCache`` instead, without a run
        (when every image of the prompt is in it)."""
        self._sweep_orphans()
        uuids = [check_name(u) for u in dict.fromkeys(img.uuid for img in mm.images)]
        if cached:
            found = {u: self._outputs.get(u) for u in uuids}
            if all(found.values()):
                return [(u, found[u] or b"") for u in uuids]
        nonce = secrets.token_hex(6)
        names = {u: f"{u}-{nonce}" for u in uuids}
        images = [msgspec.structs.replace(img, uuid=names[img.uuid], encoder_output=None) for img in mm.images]
        prompt = TokensPrompt(token_ids=list(token_ids), mm=msgspec.structs.replace(mm, images=images))
        finish = None
        try:
            async for out in generate(prompt, _ENCODE_SAMPLING, request_id):
                finish = out.finish_reason or finish
        except BaseException:
            # cancelled or failed: the step in flight may still write its files, swept later too
            for name in names.values():
                drop_output(self._root, name)
            self._orphans.update(dict.fromkeys(names.values(), time.monotonic()))
            raise
        got = {u: take_output(self._root, name) for u, name in names.items()}
        if finish == "abort":
            raise EncodeFailed(f"encode request {request_id} was aborted")
        missing = [u for u, data in got.items() if data is None]
        if missing:
            raise EncodeFailed(f"the engine wrote no encoder output for image(s) "
                               f"{', '.join(u[:16] for u in missing)} (finish: {finish})")
        for u, data in got.items():
            self._outputs.put(u, data or b"")
        return [(u, got[u] or b"") for u in uuids]

    def _sweep_orphans(self) -> None:
        now = time.monotonic()
        for name, since in list(self._orphans.items()):
            drop_output(self._root, name)
            if now - since > _ORPHAN_TTL_S:
                del self._orphans[name]

    async def probe(self, generate: Generate, model_config: Any, request_id: str) -> None:
        """One encoder run on a built-in 32x32 image, bypassing the output cache. The prompt is
        built once, in a thread (vLLM's processor takes about a second to create)."""
        if self._probe is None:
            self._probe = await asyncio.to_thread(probe_prompt, model_config)
        token_ids, mm = self._probe
        await self.encode(generate, mm, token_ids, request_id, cached=False)


def probe_prompt(model_config: Any) -> tuple[list[int], MultiModalInput]:
    """The probe's prompt, expanded by vLLM's processor for this model: the placeholder text vLLM
    itself profiles with, and a 32x32 PNG named by its sha256."""
    from PIL import Image
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    img = Image.new("RGB", (32, 32))
    img.putdata([(x * 8, y * 8, (x + y) * 4) for y in range(32) for x in range(32)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    data = buf.getvalue()
    uuid = hashlib.sha256(data).hexdigest()
    proc = MULTIMODAL_REGISTRY.create_processor(model_config)
    source = proc.info.get_tokenizer().encode(proc.dummy_inputs.get_dummy_text({"image": 1}),
                                              add_special_tokens=False)
    out: Any = proc.apply(ProcessorInputs(prompt=list(source), mm_data_items=proc.info.parse_mm_data({"image": [img]}),
                                          mm_uuid_items={"image": [uuid]}), TimingContext(enabled=False))
    (rng,) = out["mm_placeholders"]["image"]
    ids = list(out["prompt_token_ids"])
    return ids, MultiModalInput(images=[ImageInput(uuid=uuid, data=data)], source_ids=list(source),
                                prompt_len=len(ids), placeholders=[(int(rng.offset), int(rng.length))])
