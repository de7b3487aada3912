"""The LoRA adapters the mocker holds loaded, like vLLM's CPU LoRA cache: at most ``capacity``
(``max_cpu_loras``), the least recently used evicted to make room. Which adapters share one running
batch (``max_loras``) is the scheduler's business, not this one's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from actors.engines.protocol import LoraRef

logger = logging.getLogger(__name__)


class LoadedLoras:
    def __init__(self, capacity: int, owner: str) -> None:
        self.capacity = capacity
        self.owner = owner  # the engine id, for the log
        self._loaded: OrderedDict[str, LoraRef] = OrderedDict()  # least recently used first

    def add(self, lora: LoraRef) -> None:
        if lora.name in self._loaded:
            self._loaded.move_to_end(lora.name)
            return
        while len(self._loaded) >= self.capacity:
            old, _ = self._loaded.popitem(last=False)
            logger.info("mocker %s evicts LoRA %s (capacity %d)", self.owner, old, self.capacity)
        self._loaded[lora.name] = lora

    def remove(self, lora: LoraRef) -> bool:
        """Drop the adapter with ``lora``'s int id; False when none is loaded."""
        for name, ref in list(self._loaded.items()):
            if ref.int_id == lora.int_id:
                del self._loaded[name]
                return True
        return False

    def ids(self) -> list[int]:
        return sorted(r.int_id for r in self._loaded.values())
