"""What one request may ask of a model: vLLM's request checks against the model's real limits
(``SamplingParams._verify_args``/``verify``, the renderer's token-id check), written once.

The frontend, the worker and the mocker all run these, so a request is refused with the same words
wherever it enters (HTTP, NATS straight to a worker, the engine), and before anything is allocated
for it: the mocker once built one list entry per requested logprob, so ``logprobs: 2**63`` grew
until the OOM killer stopped the worker. Every check also keeps integers within what the next hop
can carry (msgpack ints end at 2**64, vLLM keeps token ids and top_k in int32 buffers).

Each check raises ``LimitError``: a ``ValueError`` (what an engine raises for a bad request) that
names the offending field in ``param``, the way vLLM's ``VLLMValidationError`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from actors.engines.protocol import ModelFacts, SamplingOptions

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM keeps token ids and top_k in int32 tensors: the bound when a model's vocabulary is unknown
INT32_MAX = 2**31 - 1
DEFAULT_MAX_LOGPROBS = 20  # vLLM's ModelConfig.max_logprobs default (--max-logprobs)
# Stop strings: the frontend holds back up to the longest stop string's length - 1 characters of
# output and scans every delta for each of them, so their number and size bound both the latency
# they add and the per-token work. OpenAI allows 4 (vLLM's OpenAI models too); 16 is for clients
# that talk to a worker over NATS. 1024 characters is far beyond any real stop sequence.
MAX_STOP = 16
MAX_STOP_CHARS = 1024
# bad_words become token sequences the engine matches at every step: same size rule, a longer list
MAX_BAD_WORDS = 256
_SHOWN = 5  # offending ids named in a message (a million-id list must not make a megabyte message)


class LimitError(ValueError):
    """A request beyond the model's limits; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int | None = None  # None: unknown (a model card from before it was recorded)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # -1: the whole vocabulary (vLLM's meaning)
    max_model_len: int | None = None

    @classmethod
    def of(cls, facts: ModelFacts) -> Limits:
        return cls(vocab_size=facts.vocab_size, max_logprobs=facts.max_logprobs,
                   max_model_len=facts.max_model_len)

    @property
    def id_bound(self) -> int:
        """Token ids are in [0, id_bound)."""
        return self.vocab_size if self.vocab_size is not None else INT32_MAX

    @property
    def logprobs_cap(self) -> int:
        return self.id_bound if self.max_logprobs == -1 else self.max_logprobs


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _vocab_text(limits: Limits) -> str:
    return (f"Vocabulary size: {limits.vocab_size}" if limits.vocab_size is not None
            else f"token ids must be in [0, {limits.id_bound})")


def check_prompt_ids(ids: list[int], limits: Limits, param: str = "prompt") -> None:
    """vLLM's renderer check (``validate_token_ids``), with its words."""
    if not ids:
        return
    # the type set is one C loop; a prompt of plain ints (every decoder's) needs no per-id call
    if set(map(type, ids)) != {int} and not all(_is_int(t) for t in ids):
        raise LimitError("token ids must be integers", param)
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise LimitError(f"Token id {lo} is out of vocabulary", param)
    if hi >= limits.id_bound:
        raise LimitError(f"Token id {hi} is out of vocabulary", param)


def check_token_ids(ids: Iterable[Any], limits: Limits, param: str) -> None:
    """Token ids of a sampling field (stop_token_ids, logit_bias keys): vLLM's wording."""
    bound = limits.id_bound
    bad = [t for t in ids if not _is_int(t) or not 0 <= t < bound]
    if bad:
        shown = ", ".join(repr(t) for t in bad[:_SHOWN]) + (", ..." if len(bad) > _SHOWN else "")
        raise LimitError(f"token_id(s) [{shown}] in {param} contain out-of-vocab token ids. "
                         f"{_vocab_text(limits)}", param)


def check_logprobs(n: Any, limits: Limits, param: str = "logprobs", kind: str = "sample") -> None:
    """``n`` top logprobs per token (-1: the whole vocabulary), at most ``max_logprobs``."""
    if n is None:
        return
    if not _is_int(n) or n < -1:
        raise LimitError(f"{param} must be non-negative or -1, got {n!r}.", param)
    wanted = limits.id_bound if n == -1 else n
    if wanted > limits.logprobs_cap:
        raise LimitError(f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: "
                         f"{limits.logprobs_cap}", param)


def check_top_k(k: Any, limits: Limits) -> None:
    """0 or -1: off; otherwise 1 .. vocabulary size (a larger k would select the whole vocabulary,
    so it is a client's mistake, and an unbounded int overflows the engine's int32 buffer)."""
    if not _is_int(k):
        raise LimitError(f"top_k must be an integer, got {type(k).__name__}", "top_k")
    if k < -1:
        raise LimitError(f"top_k must be 0 (disable), or at least 1, got {k}.", "top_k")
    if k > limits.id_bound:
        raise LimitError(f"top_k must be at most the vocabulary size ({limits.id_bound}), got {k}.", "top_k")


def check_seed(seed: Any, fan_out: int = 1) -> None:
    """A 64-bit seed; with ``fan_out`` copies seeded seed .. seed+fan_out-1, all of them."""
    if seed is None:
        return
    if not _is_int(seed) or not INT64_MIN <= seed <= INT64_MAX - (fan_out - 1):
        top = INT64_MAX - (fan_out - 1)
        raise LimitError(f"seed must be an integer in [{INT64_MIN}, {top}]"
                         + (f" (n={fan_out} copies use seed .. seed+{fan_out - 1})" if fan_out > 1 else "")
                         + f", got {seed!r}", "seed")


def check_strings(values: Any, param: str, max_count: int) -> None:
    """stop / bad_words: a list of at most ``max_count`` non-empty strings of MAX_STOP_CHARS or less."""
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise LimitError(f"{param} must be a list of strings", param)
    if len(values) > max_count:
        raise LimitError(f"{param} may hold at most {max_count} strings, got {len(values)}", param)
    for s in values:
        if not s:
            raise LimitError(f"{param} cannot contain an empty string.", param)
        if len(s) > MAX_STOP_CHARS:
            raise LimitError(f"each of {param} may be at most {MAX_STOP_CHARS} characters, got one of "
                             f"{len(s)}", param)


def _check_logit_bias(bias: Any, limits: Limits) -> None:
    if not isinstance(bias, Mapping):
        raise LimitError("logit_bias must map token ids to biases", "logit_bias")
    # JSON object keys are strings: a worker's JSON clients send "50256", msgpack carries ints
    keys = [int(k) if isinstance(k, str) and k.lstrip("-").isdecimal() else k for k in bias]
    check_token_ids(keys, limits, "logit_bias")
    for v in bias.values():
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise LimitError(f"logit_bias values must be finite numbers, got {v!r}", "logit_bias")


def _check_extra(extra: Mapping[str, Any], limits: Limits) -> None:
    """The SamplingParams fields that travel in ``SamplingOptions.extra``."""
    if "logit_bias" in extra and extra["logit_bias"] is not None:
        _check_logit_bias(extra["logit_bias"], limits)
    allowed = extra.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed:
            raise LimitError("allowed_token_ids is not None and empty!", "allowed_token_ids")
        check_token_ids(allowed, limits, "allowed_token_ids")
    check_logprobs(extra.get("prompt_logprobs"), limits, "prompt_logprobs", kind="prompt")
    if extra.get("bad_words") is not None:
        check_strings(extra["bad_words"], "bad_words", MAX_BAD_WORDS)


def check_sampling_limits(s: SamplingOptions, limits: Limits) -> None:
    """Everything in ``s`` that depends on the model or could overflow on the way to the engine."""
    top = limits.max_model_len or INT64_MAX
    if not _is_int(s.max_tokens) or s.max_tokens > top:
        within = (f"the model's maximum context length ({top})" if limits.max_model_len is not None
                  else f"{top}")
        raise LimitError(f"max_tokens must be at most {within}, got {s.max_tokens!r}", "max_tokens")
    if not _is_int(s.min_tokens) or not 0 <= s.min_tokens <= s.max_tokens:
        raise LimitError(f"min_tokens must be in [0, max_tokens={s.max_tokens}], got {s.min_tokens!r}",
                         "min_tokens")
    check_logprobs(s.logprobs, limits)
    check_top_k(s.top_k, limits)
    check_seed(s.seed)
    check_strings(s.stop, "stop", MAX_STOP)
    check_token_ids(s.stop_token_ids, limits, "stop_token_ids")
    _check_extra(s.extra, limits)
