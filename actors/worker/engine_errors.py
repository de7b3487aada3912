"""An engine's refusals as typed errors (no NATS, no engine): of a request, and of its own start.

Engines check some requests only when they run them (text-mode prompts are tokenized there, vLLM
validates its own parameters): their exceptions are turned into a 400 in vLLM's OpenAI wording
here, so ``serving`` keeps to admitting and streaming. An engine that rejects its configuration
at start (``EngineConfigError``) will reject it on every start: that is a ``Misconfigured``
failure, which the worker's supervisor does not retry in place (``start_failure``).
"""

from __future__ import annotations

import re
import sys

from actors.engines.config_error import EngineConfigError
from actors.worker.validation import context_length_message
from bus.errors import BadRequest
from supervisors.child import Misconfigured

# Prompt-too-long errors of the engines: vLLM ("The decoder prompt (length N) is longer than the
# maximum model length ...") and the mocker ("prompt has N tokens; max_model_len is M").
_TOO_LONG = re.compile(r"prompt \(length (\d+)\) is longer|prompt has (\d+) tokens; max_model_len")


def is_request_error(e: Exception) -> bool:
    """An engine's refusal of the request itself: a ValueError (the mocker, LimitError, older vLLM)
    or one of vLLM's VLLMClientErrors (VLLMValidationError is not a ValueError). vllm is only loaded
    where a vLLM engine runs, so it is looked up, never imported (a mocker worker stays without it)."""
    if isinstance(e, ValueError):
        return True
    vllm_exceptions = sys.modules.get("vllm.exceptions")
    client_error = getattr(vllm_exceptions, "VLLMClientError", None)
    return client_error is not None and isinstance(e, client_error)


def message_of(e: Exception) -> str:
    """The refusal's own words: vLLM's str() appends "(parameter=..., value=...)"."""
    return str(e.args[0]) if e.args else str(e)


def refusal(e: Exception, max_model_len: int, max_tokens: int) -> BadRequest:
    """The 400 for a generate request an engine refused (``is_request_error(e)``): a prompt over
    the context in the frontend's context-length wording, anything else in the engine's words."""
    message = message_of(e)
    m = _TOO_LONG.search(message)
    if m:
        return BadRequest(context_length_message(max_model_len, int(m.group(1) or m.group(2)), max_tokens))
    return BadRequest(message, param=getattr(e, "param", None) or getattr(e, "parameter", None))


def start_failure(e: BaseException) -> BaseException:
    """What an engine's failed start becomes: ``Misconfigured`` when the engine rejected its
    configuration (the same error on every start), else the error itself (an engine that died,
    ran out of memory once, lost its port: a restart may help)."""
    if isinstance(e, EngineConfigError):
        return Misconfigured(f"engine configuration rejected: {e}")
    return e
