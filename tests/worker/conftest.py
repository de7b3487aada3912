"""Fixtures shared by the worker tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def adapter_root(tmp_path: Path) -> Path:
    """A LoRA root holding one (config-only) adapter ``a1``."""
    a = tmp_path / "adapters" / "a1"
    a.mkdir(parents=True)
    (a / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    return tmp_path / "adapters"
