"""The request side of the OpenAI wire format: validation with vLLM's own protocol models, mapping
to SamplingOptions, and OpenAI-shaped error bodies (responses are shaped in ``responses``).

Validation reuses ``ChatCompletionRequest``/``CompletionRequest`` and their ``to_sampling_params``
(which runs vLLM's SamplingParams checks), so the accepted surface and the 400 messages match
vLLM's server. Importing these models loads vLLM's config classes but never builds an engine.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import pydantic
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

from actors.engines.protocol import SamplingOptions, StructuredOutput
from bus.errors import ActorError, BadRequest

_enc = msgspec.json.Encoder()
encode_json = _enc.encode

# SamplingParams fields with no SamplingOptions slot that still matter to the engine.
_EXTRA_FIELDS = ("logit_bias", "bad_words", "allowed_token_ids", "prompt_logprobs")


@dataclass(slots=True)
class OutputOptions:
    """What the frontend itself does with the output (detokenize, stop, logprobs shape)."""

    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logprobs: int | None  # top-N per token; None = no logprobs
    echo: bool = False


def as_bad_request(e: Exception) -> BadRequest:
    if isinstance(e, pydantic.ValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = first.get("msg", str(e))
        return BadRequest(f"{loc}: {msg}" if loc else msg,
                          param=str(first["loc"][0]) if first.get("loc") else None)
    return BadRequest(str(getattr(e, "args", [e])[0]) if getattr(e, "args", None) else str(e),
                      param=getattr(e, "parameter", None))


# Fields vLLM's "before" model validators read before pydantic has checked their types: each one
# iterates or .get()s its field, so another type is a TypeError/AttributeError out of pydantic.
_READ_EARLY: dict[str, tuple[type, ...]] = {"messages": (list,), "structured_outputs": (dict, type(None)),
                                           # /v1/responses: read by its tool_choice validator
                                           "tools": (list, type(None))}
_TYPE_WORDS = {list: "a valid list", dict: "a valid dictionary"}


def _early_read_error(body: bytes) -> BadRequest | None:
    """The field of ``body`` that made one of vLLM's early validators fail, as pydantic would have
    named it; None when it is not one of those (then the failure is a bug, not the input)."""
    try:
        data = json.loads(body)  # the slow path only; jiter already bounded the nesting depth
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for name, types in _READ_EARLY.items():
        if name in data and not isinstance(data[name], types):
            return BadRequest(f"{name}: Input should be {_TYPE_WORDS[types[0]]}", param=name)
    # vLLM's message normalizer runs list() over each message's tool_calls before pydantic checks it
    for i, msg in enumerate(data.get("messages") or []):
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        if isinstance(calls, int | float):  # a bool is an int
            return BadRequest(f"messages.{i}.tool_calls: Input should be iterable", param="messages")
    return None


def validate_json(model: type[pydantic.BaseModel], body: bytes) -> Any:
    """``body`` as one of vLLM's pydantic request models; any failure is a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except (pydantic.ValidationError, ValueError, VLLMValidationError) as e:
        raise as_bad_request(e) from None
    except (TypeError, AttributeError):
        err = _early_read_error(body)
        if err is None:
            raise
        raise err from None


def parse_chat(body: bytes) -> ChatCompletionRequest:
    return check_chat(validate_json(ChatCompletionRequest, body))


def check_chat(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """What a chat request must hold beyond vLLM's model (also one another API was translated to)."""
    if not req.messages:
        raise BadRequest("messages must not be empty")
    if req.use_beam_search:
        raise BadRequest("use_beam_search is not supported")
    return req


def check_request_template(template: str | None, trusted: bool) -> None:
    """A request's own chat template runs only where the operator allowed it."""
    if template is not None and not trusted:
        raise BadRequest("a chat_template in the request is refused: set frontend.trust_request_chat_template "
                         "= true in the topology to allow it (vllm serve: --trust-request-chat-template)",
                         param="chat_template")


def parse_completion(body: bytes) -> CompletionRequest:
    req: CompletionRequest = validate_json(CompletionRequest, body)
    if req.prompt is None and req.prompt_embeds is None:
        raise BadRequest("either prompt or prompt_embeds is required")
    if req.use_beam_search:
        raise BadRequest("use_beam_search is not supported")
    if req.suffix:
        raise BadRequest("suffix is not supported")
    return req


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest, body: bytes = b"") -> int | None:
    """The client's output limit, None = "the context left". CompletionRequest fills in 16 when the
    field is absent (a validator marks it as set), so absence is checked on the raw body."""
    if isinstance(req, ChatCompletionRequest):
        # read through __dict__: the attribute access warns (max_tokens is deprecated for chat)
        mct = req.max_completion_tokens
        return mct if mct is not None else req.__dict__.get("max_tokens")
    return req.max_tokens if b'"max_tokens"' in body else None


def to_sampling(req: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                text_mode: bool) -> tuple[SamplingOptions, OutputOptions]:
    """vLLM's to_sampling_params (validation + defaults), then SamplingParams → SamplingOptions."""
    try:
        sp = req.to_sampling_params(max_tokens, {})
    except (ValueError, TypeError, VLLMValidationError) as e:
        raise as_bad_request(e) from None
    so = sp.structured_outputs
    structured = None
    if so is not None:
        structured = StructuredOutput(json=so.json, json_object=so.json_object, regex=so.regex,
                                      choice=so.choice, grammar=so.grammar, structural_tag=so.structural_tag)
    extra: dict[str, Any] = {}
    for name in _EXTRA_FIELDS:
        v = getattr(sp, name, None)
        # an empty allowed_token_ids is kept: dropped as "unset" it would sample from the whole
        # vocabulary; the limits refuse it as vLLM's engine does
        if v or (name == "allowed_token_ids" and v is not None):
            extra[name] = v
    if getattr(req, "kv_transfer_params", None):
        raise BadRequest("kv_transfer_params is set by the frontend, not by clients")
    stop = list(sp.stop or [])
    opts = SamplingOptions(
        max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        min_p=sp.min_p, seed=sp.seed, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
        # token mode: the frontend detokenizes and enforces stop strings; the worker need not.
        stop=stop if text_mode else [], stop_token_ids=list(sp.stop_token_ids or []),
        ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens, logprobs=sp.logprobs,
        structured=structured, detokenize=text_mode, extra=extra)
    out = OutputOptions(stop=stop, include_stop_str_in_output=sp.include_stop_str_in_output,
                        skip_special_tokens=sp.skip_special_tokens, logprobs=sp.logprobs,
                        echo=bool(getattr(req, "echo", False)) and isinstance(req, CompletionRequest))
    return opts, out


# --- errors -----------------------------------------------------------------------------------------
# A 503 is always temporary here (starting, restarting, no worker free, no connection slot free):
# every one says when to try again.
RETRY_AFTER_S = "1"


def error_body(err: ActorError) -> bytes:
    return encode_json({"error": {"message": err.message, "type": err.kind,
                                  "param": err.param, "code": err.code}})


# --- ids ---------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
