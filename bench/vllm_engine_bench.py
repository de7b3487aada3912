"""Benchmark VllmEngine with the tiny model: start-up time, single-stream and 32-concurrent tok/s.

    .venv/bin/python bench/vllm_engine_bench.py [--model tiny] [--tokens 256] [--concurrency 32]
                                                [--no-write]

Writes its numbers into docs/benchmarks.md, section "vLLM engine (CPU, tiny model)" (only that
section is touched). Random weights make the text meaningless but the compute is real.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECTION = "vLLM engine (CPU, tiny model)"
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


async def run(args: argparse.Namespace) -> dict[str, float]:
    from actors.engines.protocol import SamplingOptions, TokensPrompt

    t0 = time.perf_counter()
    import vllm  # noqa: F401  (timed: importing vLLM is a large part of a cold start)

    from actors.engines.vllm_engine import VllmEngine

    t_import = time.perf_counter() - t0
    engine = VllmEngine({"model": args.model, "max_model_len": 1024, "dtype": "bfloat16",
                         "kv_cache_memory_bytes": 256 << 20},
                        env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    t1 = time.perf_counter()
    await engine.start()
    t_start = time.perf_counter() - t1
    sampling = SamplingOptions(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def prompt(i: int) -> TokensPrompt:
        return TokensPrompt([5 + (i * 7919 + j * 104729) % 2000 for j in range(64)])

    async def one(i: int) -> int:
        n = 0
        async for out in engine.generate(prompt(i), sampling, f"bench-{i}"):
            n += len(out.token_ids)
        return n

    try:
        await one(10_000)  # warm-up
        t2 = time.perf_counter()
        n1 = await one(0)
        single = n1 / (time.perf_counter() - t2)
        t3 = time.perf_counter()
        counts = await asyncio.gather(*(one(100 + i) for i in range(args.concurrency)))
        conc = sum(counts) / (time.perf_counter() - t3)
    finally:
        await engine.shutdown()
    return {"import_s": t_import, "start_s": t_start, "single_tok_s": single, "conc_tok_s": conc}


def write_section(text: str) -> None:
    doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^## {re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    block = f"## {SECTION}\n\n{text.strip()}\n\n"
    doc = pattern.sub(lambda _: block, doc) if pattern.search(doc) else doc.rstrip("\n") + "\n\n" + block
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(doc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens", type=int, default=256, help="generated tokens per request")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()
    r = asyncio.run(run(args))
    cores = len(os.sched_getaffinity(0))
    text = f"""Command: `.venv/bin/python bench/vllm_engine_bench.py --tokens {args.tokens} --concurrency {args.concurrency}`
(vllm {__import__('vllm').__version__}, {platform.machine()}, {cores} cores; 64-token prompts, greedy,
`ignore_eos`, engine defaults of `VllmEngine` on CPU: eager, block 32, `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
`OMP_NUM_THREADS=1`, EngineCore pinned to core 0, 256 MiB KV cache).

| metric | value |
|---|---|
| import vllm (parent process) | {r['import_s']:.1f} s |
| engine start (`await VllmEngine.start()`) | {r['start_s']:.1f} s |
| single stream, {args.tokens} tokens | {r['single_tok_s']:.0f} tok/s |
| {args.concurrency} concurrent × {args.tokens} tokens | {r['conc_tok_s']:.0f} tok/s |

Measured while other helpers' tests and engines shared the same 2 cores, so expect ±20 % or more
between runs; these numbers are a rough floor, not a capacity figure."""
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
