"""Image prompts at the frontend: what an image chat costs before it reaches a worker.

    .venv/bin/python bench/mm_bench.py [--model tiny-vlm] [--runs 50] [--write docs/benchmarks.md]

Measured in this process, one thread (the frontend runs each step in a worker thread):
- building vLLM's multimodal processor for the model (once per model path and context length);
- decoding a PNG as the frontend does (header check, EXIF orientation, RGB: media.py);
- expanding a prompt's image placeholder with vLLM's processor (mm_processor.py: resizing and tiling
  by the model's HF image processor; the pixel values are thrown away);
- the router's block hashes of a 2,048-token prompt with 0, 1 and 4 images folded in.
``--model``: a model directory or one of the project's names (tiny-vlm, built by
``python -m actors.models.tiny_vlm``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PIL import Image  # noqa: E402

from actors.engines.mm_keys import MmSpan  # noqa: E402
from actors.frontend.media import _decode_sync  # noqa: E402
from actors.frontend.mm_processor import MmProcessor  # noqa: E402
from actors.kv.hashing import sequence_hashes  # noqa: E402
from actors.models.tiny import resolve_model_path  # noqa: E402
from bench.docs_section import write_section  # noqa: E402
from config.topology import MediaConfig  # noqa: E402

SIZES = ((64, 48), (640, 480), (1920, 1080))
BLOCK = 32


def png(w: int, h: int) -> bytes:
    img = Image.effect_noise((w, h), 64).convert("RGB")  # noise: no size advantage from compression
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def timed(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median and p90 of ``runs`` calls after one warm-up call, in milliseconds."""
    fn()
    ms = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1000)
    ms.sort()
    return statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-vlm")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--write", type=Path, help="write the results as a section of this markdown file")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    rows: list[str] = []

    t0 = time.perf_counter()
    proc = MmProcessor(path, 1024)
    build_s = time.perf_counter() - t0
    tok = proc.processor.info.get_tokenizer()
    source = tok.encode(proc.processor.dummy_inputs.get_dummy_text({"image": 1}), add_special_tokens=False)
    cfg = MediaConfig(max_pixels=4096 * 4096)
    rows.append(f"| processor build ({args.model}) | {build_s * 1000:.0f} ms once | |")

    expanded_len = 0
    for w, h in SIZES:
        data = png(w, h)
        img = _decode_sync(data, "bench", cfg)
        d_med, d_p90 = timed(lambda data=data: _decode_sync(data, "bench", cfg), args.runs)  # type: ignore[misc]
        e_med, e_p90 = timed(lambda img=img: proc.expand(source, [img]), args.runs)  # type: ignore[misc]
        out = proc.expand(source, [img])
        expanded_len = len(out.token_ids)
        rows.append(f"| decode {w}x{h} PNG ({len(data) // 1024} KiB) | {d_med:.2f} ms | {d_p90:.2f} ms |")
        rows.append(f"| expand {w}x{h} ({len(source)} -> {expanded_len} tokens) | {e_med:.2f} ms | {e_p90:.2f} ms |")

    tokens = list(range(1000, 1000 + 2048))
    for n in (0, 1, 4):
        spans = [MmSpan(identifier=hashlib.sha256(bytes([i])).hexdigest(), offset=100 + 400 * i, length=64)
                 for i in range(n)]
        med, p90 = timed(lambda spans=spans: sequence_hashes(tokens, BLOCK, mm=spans), args.runs * 20)  # type: ignore[misc]
        rows.append(f"| router hashes, 2,048 tokens, {n} image(s) | {med * 1000:.1f} µs | {p90 * 1000:.1f} µs |")

    cmd = ("Command: `.venv/bin/python bench/mm_bench.py " + " ".join(sys.argv[1:])).rstrip() + "`"
    body = "\n".join([
        cmd, "",
        f"Model {args.model}, median and p90 of {args.runs} runs (hashes: {args.runs * 20}), one thread, on "
        "the shared 2-core box. Noise PNGs, so the file sizes are near the worst case. The frontend "
        "decodes and expands in a worker thread, not on its event loop. The tiny VLM resizes every "
        "image to 64 px on its longest edge and tiles it into 32-px tiles (4 tiles and a global view: 33 "
        "tokens), so expansion mostly costs the resize. A real VLM's processor tiles "
        "more and costs more.", "",
        "| step | median | p90 |", "|---|---|---|", *rows])
    print(body)
    if args.write:
        write_section(args.write, "Image prompts at the frontend", body)


if __name__ == "__main__":
    main()
