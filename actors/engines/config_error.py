"""An engine configuration the engine rejects, for any engine (vLLM's config, the mocker's args).

Its own module, so that the worker, the root's start-up check and ``--check`` recognise it without
importing an engine.
"""

from __future__ import annotations


class EngineConfigError(ValueError):
    """The engine rejects its configuration: the same error on every start, so a restart cannot
    help (a worker gives up on it; the root refuses such a topology at start-up and in ``--check``).
    ``keys``: the engine args the error is about, where that can be told (empty: the args as a
    whole)."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys
