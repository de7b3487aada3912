"""Values that are slow to build and never change (tokenizers, vLLM's multimodal processors): built
on first use, once per key, for the whole process. Thread-safe: builds run in worker threads, off
the event loop, and ``peek`` lets the loop take a built one without a thread hop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BuiltOnce(Generic[K, V]):
    def __init__(self, what: str, build: Callable[[K], V]) -> None:
        """``what``: named in the log line of each build; ``build``: makes the value of a key."""
        self._what = what
        self._build = build
        self._items: dict[K, V] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V:
        """The value of ``key``, built now (blocking) if it is not yet."""
        value = self._items.get(key)
        if value is None:
            with self._lock:
                value = self._items.get(key)
                if value is None:
                    log.info("loading %s %s", self._what, key)
                    value = self._items[key] = self._build(key)
        return value

    def peek(self, key: K) -> V | None:
        return self._items.get(key)
