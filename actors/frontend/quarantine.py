"""Poison-request containment: a request that was being served by two workers as each of them died
is not sent a third time, and identical requests are refused for a while.

One request can crash every worker it reaches (an input that makes the engine allocate without
bound, a kernel fault on a shape). Migration would carry it from worker to worker, and each death
adds to the supervisors' restart intensity until the whole deployment gives up. Two deaths are
the evidence: the first may be a coincidence (a worker SIGKILLed under many streams), so the
request is retried once; if the worker serving the retry dies too, the request fails, and its
fingerprint (model, adapter, prompt, sampling) is refused until ``ttl`` passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import msgspec
import xxhash

from actors.engines.protocol import SamplingOptions
from bus.errors import ActorError, BadRequest

log = logging.getLogger(__name__)

# deaths of the workers serving one request after which it is not sent again
DEATHS_TO_QUARANTINE = 2

_enc = msgspec.msgpack.Encoder()


class PoisonRequest(ActorError):
    """The workers serving this request died twice while serving it: it is not sent again."""

    code = 500
    kind = "internal_error"


class QuarantinedRequest(BadRequest):
    """Identical to a request that took two workers down: refused without reaching a worker (a 4xx,
    so that clients which retry 5xx do not send it again)."""


def fingerprint(model: str, lora: str | None, token_ids: Sequence[int] | None, prompt: str | None,
                sampling: SamplingOptions) -> str:
    """What makes two requests the same to an engine. ``seed`` is left out: the copies of an ``n>1``
    request differ only in it (seed+i), and a crash on one is a crash on all."""
    body = _enc.encode((model, lora, list(token_ids) if token_ids is not None else None, prompt,
                        msgspec.structs.replace(sampling, seed=None)))
    return xxhash.xxh3_128_hexdigest(body)


class Quarantine:
    def __init__(self, ttl: float = 300.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        # fingerprint -> monotonic expiry, in insertion order, which is expiry order (one ttl)
        self._until: dict[str, float] = {}
        self.total = 0
        # told of each fingerprint this process quarantines (shared with the other frontends:
        # actors.frontend.shared_quarantine)
        self.on_added: Callable[[str, str, Sequence[str]], None] | None = None

    def __len__(self) -> int:
        """Fingerprints quarantined now: flows skip hashing their prompt while this is 0, so expired
        entries must not keep it up."""
        now = time.monotonic()
        while self._until and next(iter(self._until.values())) <= now:
            del self._until[next(iter(self._until))]
        return len(self._until)

    def check(self, fp: str) -> None:
        """Raise QuarantinedRequest while ``fp`` is quarantined."""
        until = self._until.get(fp)
        if until is None:
            return
        left = until - time.monotonic()
        if left <= 0:
            del self._until[fp]
            return
        raise QuarantinedRequest(f"request refused: an identical request was being served by two workers "
                                 f"as each of them died, so it is quarantined for another {left:.0f}s")

    def _insert(self, fp: str) -> None:
        self._until.pop(fp, None)  # re-added: to the end, keeping insertion order = expiry order
        if len(self._until) >= self.max_entries:  # bounded: drop the entry closest to expiry
            del self._until[next(iter(self._until))]
        self._until[fp] = time.monotonic() + self.ttl

    def adopt(self, fp: str) -> None:
        """Another frontend quarantined ``fp``: refuse it here too, for ``ttl`` from now (its
        entry in the shared bucket ends it earlier, through ``release``)."""
        if self.ttl > 0 and fp not in self._until:
            self._insert(fp)

    def release(self, fp: str) -> None:
        """The shared entry of ``fp`` expired (or an operator deleted it): refuse it no more."""
        self._until.pop(fp, None)

    def add(self, fp: str, request_id: str, workers: Sequence[str]) -> PoisonRequest:
        """Quarantine ``fp``; the error to fail the request with."""
        self.total += 1
        if self.ttl > 0:
            self._insert(fp)
            if self.on_added is not None:
                self.on_added(fp, request_id, workers)
        log.error("request %s quarantined: workers %s died while serving it; not retried%s", request_id,
                  ", ".join(workers), f", identical requests refused for {self.ttl:g}s" if self.ttl > 0 else "")
        return PoisonRequest(f"request failed: the workers serving it ({', '.join(workers)}) died while "
                             f"serving it; it is not retried"
                             + (f", and identical requests are refused for {self.ttl:g}s" if self.ttl > 0 else ""))
