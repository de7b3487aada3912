"""The model's limits applied to an OpenAI request at the frontend, so a request the engine would
refuse (or choke on) is a 400 here, with the field named, before any worker sees it.

The rules themselves are the engine's (``actors.engines.limits``); the limits travel with the model
in its card. What is only the frontend's: ``n`` (it fans out copies), the number of choices one
request may start, and the names of the OpenAI fields (chat asks for ``top_logprobs``).
"""

from __future__ import annotations

from actors.engines.limits import (
    MAX_STOP,
    LimitError,
    Limits,
    check_prompt_ids,
    check_sampling_limits,
    check_seed,
    check_strings,
)
from actors.engines.protocol import SamplingOptions
from actors.instances.contract import ModelCard
from bus.errors import BadRequest

MAX_N = 128
# Every choice (prompt x n) is a worker request and a task here; an 8 MiB body of one-token prompts
# could otherwise start millions of them.
MAX_CHOICES = 4096


def card_limits(card: ModelCard) -> Limits:
    return Limits(vocab_size=card.vocab_size, max_logprobs=card.max_logprobs,
                  max_model_len=card.context_length)


def _bad(e: LimitError, chat: bool) -> BadRequest:
    param = e.param
    if chat and param == "logprobs":
        param = "top_logprobs"  # what a chat client set (its "logprobs" is only a switch)
    return BadRequest(str(e), param=param)


def check_fan_out(n: int, prompts: int) -> None:
    if n < 1 or n > MAX_N:
        raise BadRequest(f"n must be between 1 and {MAX_N}", param="n")
    if prompts * n > MAX_CHOICES:
        raise BadRequest(f"{prompts} prompts x n={n} would start {prompts * n} completions; at most "
                         f"{MAX_CHOICES} per request", param="prompt" if n == 1 else "n")


def check_prompt(ids: list[int], limits: Limits, chat: bool) -> None:
    """Token ids a client sent as its prompt."""
    try:
        check_prompt_ids(ids, limits)
    except LimitError as e:
        raise _bad(e, chat) from None


def check_sampling(so: SamplingOptions, stop: list[str], n: int, limits: Limits, chat: bool) -> None:
    """One prompt's worker options; ``stop``: the stop strings the frontend enforces itself."""
    try:
        check_sampling_limits(so, limits)
        check_strings(stop, "stop", MAX_STOP)
        check_seed(so.seed, n)
    except LimitError as e:
        raise _bad(e, chat) from None
