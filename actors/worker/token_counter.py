"""The worker's own count of a text-mode prompt's tokens, for the context guard before the engine runs it."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class TokenCounter:
    """Counts text-mode prompt tokens for the context guard, from the model's tokenizer.json.

    Without a loadable tokenizer (e.g. the mocker) it returns None and the guard runs on the
    engine's own prompt count instead (first output).
    """

    def __init__(self, tokenizer_path: str | None) -> None:
        self._tok: Any = None
        if tokenizer_path:
            f = os.path.join(tokenizer_path, "tokenizer.json")
            if os.path.isfile(f):
                try:
                    from tokenizers import Tokenizer

                    self._tok = Tokenizer.from_file(f)
                except Exception as e:  # noqa: BLE001 - an unreadable tokenizer only disables the pre-check
                    log.warning("cannot load tokenizer %s: %s", f, e)

    def count(self, text: str) -> int | None:
        if self._tok is None:
            return None
        return len(self._tok.encode(text).ids)
