"""An image file decoded as ``vllm serve`` decodes it (its ImageMediaIO): EXIF orientation applied,
pixels loaded, RGB (transparency on white). The frontend (its processor copy expands the prompt) and
the worker (vLLM's processor expands it again) must decode alike, or the two expansions differ."""

from __future__ import annotations

from PIL import Image
from vllm.multimodal.image import convert_image_mode, normalize_image


def to_model_rgb(img: Image.Image) -> Image.Image:
    """``img`` (opened, header read) as the model's processor takes it; decoder errors propagate."""
    img = normalize_image(img)  # the EXIF orientation: it may swap width and height
    img.load()
    return convert_image_mode(img, "RGB")
