"""A simulated vLLM engine (scheduler, KV pool, timing model, vLLM-identical KV events)."""

from actors.engines.mocker.config import MockerArgs
from actors.engines.mocker.engine import MockerEngine

__all__ = ["MockerArgs", "MockerEngine"]
