"""Where vllm-actors keeps its files on this machine: built models, downloaded LoRA adapters,
generated identity adapters."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "VLLM_ACTORS_HOME"
DEFAULT_HOME = "~/.cache/vllm-actors"


def vllm_actors_home() -> Path:
    """``$VLLM_ACTORS_HOME``, else ``~/.cache/vllm-actors`` (an empty variable counts as unset)."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser()
