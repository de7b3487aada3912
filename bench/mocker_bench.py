"""Mocker engine throughput at zero compute: scheduler steps/s and simulated tokens/s.

    .venv/bin/python bench/mocker_bench.py [--concurrency 256] [--prompt-len 128] [--max-tokens 256]
                                           [--write docs/benchmarks.md]

256 concurrent sequences (one consumer task each, the way the engine actor reads streams) run to
completion at speedup_ratio=0 (no simulated delay): the numbers are pure Python overhead of the
scheduler, the block pool, the KV-event encoding/publishing and the output streams.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.engines.mocker.engine import MockerEngine  # noqa: E402
from actors.engines.protocol import SamplingOptions, TokensPrompt  # noqa: E402
from bench.docs_section import write_section  # noqa: E402


async def run(concurrency: int, prompt_len: int, max_tokens: int, block_size: int) -> dict[str, float]:
    e = MockerEngine({"speedup_ratio": 0, "block_size": block_size, "num_gpu_blocks": 65536,
                      "max_num_seqs": concurrency, "max_num_batched_tokens": 8192,
                      "max_model_len": prompt_len + max_tokens + 1})
    await e.start()
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        prompt = [(i * 7919 + j) % 30000 + 3 for j in range(prompt_len)]
        async for out in e.generate(TokensPrompt(prompt), SamplingOptions(max_tokens=max_tokens,
                                                                          ignore_eos=True), f"r{i}"):
            tokens += len(out.token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(concurrency)))
    dt = time.perf_counter() - t0
    steps = e.stats()[0].step
    await e.shutdown()
    assert tokens == concurrency * max_tokens, tokens
    return {"seconds": dt, "steps": steps, "steps_per_s": steps / dt, "tokens": tokens,
            "tokens_per_s": tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--write", type=pathlib.Path, default=None, help="update this markdown file")
    a = ap.parse_args()
    r = asyncio.run(run(a.concurrency, a.prompt_len, a.max_tokens, a.block_size))
    line = (f"{a.concurrency} concurrent sequences, prompt {a.prompt_len}, {a.max_tokens} output tokens, "
            f"block {a.block_size}, speedup_ratio=0: {r['steps']:.0f} steps in {r['seconds']:.2f} s = "
            f"**{r['steps_per_s']:.0f} scheduler steps/s**, **{r['tokens_per_s']:.0f} simulated tokens/s**")
    print(line)
    if a.write:
        cmd = ("`.venv/bin/python bench/mocker_bench.py --concurrency "
               f"{a.concurrency} --prompt-len {a.prompt_len} --max-tokens {a.max_tokens} "
               f"--write {a.write}`")
        body = (f"Command: {cmd}\n\n- {line}\n- Machine: {platform.machine()}, Python "
                f"{platform.python_version()}, one asyncio loop (2-core shared box; ±20 % between runs).\n"
                "- Zero compute: no simulated delay; this is the serving-layer overhead budget of the "
                "mocker itself (scheduler, block pool, KV-event encoding + ZMQ publish, output streams).\n")
        write_section(a.write, "Mocker engine", body)


if __name__ == "__main__":
    main()
