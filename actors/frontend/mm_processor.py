"""Image prompts at the frontend: vLLM's own multimodal processor expands each image placeholder of a
rendered prompt into the tokens the engine will run, and says where each image lies.

Why vLLM's processor here, and not the HF processor or the worker: the router hashes the prompt's
blocks, and an engine's KV events name each block's images by ``(image id, offset in the block)``
from vLLM's placeholder ranges. Expanding with the engine's own code (same vLLM, same model files)
gives those ranges and the expanded ids exactly, so image prompts hit in the router as they do in
the engine; the context-length check, ``max_tokens``, usage and migration all count the expanded
prompt, as vLLM does. The worker still gets the unexpanded ids (``MultiModalInput.source_ids``):
vLLM 0.32 always applies its prompt updates and would expand an expanded prompt a second time.

Building a processor reads the model's configs (no weights): about 1 s, once per model path, off the
event loop. Expanding one small image takes 1-2 ms (the HF image processor resizes and tiles it; the
pixel values are thrown away here).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from actors.engines.protocol import ImageInput, MultiModalInput
from bus.errors import BadRequest

from .built_once import BuiltOnce
from .media import LoadedImage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expanded:
    token_ids: list[int]  # the prompt as the engine runs it
    mm: MultiModalInput


class MmProcessor:
    """vLLM's multimodal processor for one model directory."""

    def __init__(self, model_path: str, max_model_len: int) -> None:
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        self.model_config = ModelConfig(model=model_path, max_model_len=max_model_len)
        if not self.model_config.is_multimodal_model:
            raise ValueError(f"{model_path} is not a multimodal model")
        self.processor = MULTIMODAL_REGISTRY.create_processor(self.model_config)
        self._lock = threading.Lock()  # the processor keeps per-call state; calls come from threads

    def expand(self, source_ids: list[int], images: list[LoadedImage]) -> Expanded:
        """``source_ids`` (the rendered prompt, one placeholder per image) expanded; a prompt whose
        placeholders do not match its images is a 400."""
        from vllm.multimodal.processing.context import TimingContext
        from vllm.multimodal.processing.inputs import ProcessorInputs

        uuids = [img.uuid for img in images]
        try:
            with self._lock:
                items = self.processor.info.parse_mm_data({"image": [img.image for img in images]})
                out: Any = self.processor.apply(
                    ProcessorInputs(prompt=list(source_ids), mm_data_items=items,
                                    mm_uuid_items={"image": uuids}),
                    TimingContext(enabled=False))
        except (ValueError, RuntimeError, TypeError) as e:
            # e.g. more images than placeholders in the template's output, or a per-prompt limit
            raise BadRequest(f"cannot place the images in the prompt: {e}", param="messages") from None
        ranges = out["mm_placeholders"].get("image", [])
        if len(ranges) != len(images):
            raise BadRequest(f"the prompt holds {len(ranges)} image placeholders for {len(images)} images",
                             param="messages")
        ids = list(out["prompt_token_ids"])
        mm = MultiModalInput(images=[ImageInput(uuid=img.uuid, data=img.data) for img in images],
                             source_ids=list(source_ids), prompt_len=len(ids),
                             placeholders=[(int(r.offset), int(r.length)) for r in ranges])
        return Expanded(ids, mm)


# one per process, keyed by (model dir, context length)
SHARED: BuiltOnce[tuple[str, int], MmProcessor] = BuiltOnce("vLLM's multimodal processor", lambda k: MmProcessor(*k))
