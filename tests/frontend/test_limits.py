"""The model's limits, without a bus: vLLM's rules (actors.engines.limits) with vLLM's words, and the
frontend refusing with a 400 naming the field before a worker sees the request (parse_* and
plan_request), with the limits read from the model card."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from actors.engines.limits import (
    INT64_MAX,
    MAX_STOP_CHARS,
    LimitError,
    Limits,
    check_logprobs,
    check_prompt_ids,
    check_sampling_limits,
    check_seed,
    check_token_ids,
    check_top_k,
)
from actors.engines.protocol import SamplingOptions
from actors.frontend.discovery import ModelEntry
from actors.frontend.limits import MAX_CHOICES, MAX_N
from actors.frontend.openai_io import parse_chat, parse_completion
from actors.frontend.planning import Plan, plan_request
from actors.frontend.preprocess import SHARED
from actors.instances.contract import ModelCard
from bus.errors import BadRequest

VOCAB = 2048
LIMITS = Limits(vocab_size=VOCAB, max_logprobs=20, max_model_len=128)
MSG = [{"role": "user", "content": "hi"}]


def card(**kw: Any) -> ModelCard:
    fields: dict[str, Any] = dict(served_model_name="tiny", pool="agg", role="agg", model_path="/x",
                                  tokenizer_path="/x", context_length=128, kv_block_size=16,
                                  total_kv_blocks=100, vocab_size=VOCAB, max_logprobs=20)
    return ModelCard(**{**fields, **kw})


@pytest.fixture(scope="module")
def pre(tiny_dir: str) -> Any:
    return SHARED.get((tiny_dir, None))


def plan(body: dict[str, Any], pre: Any, **card_kw: Any) -> Plan:
    raw = json.dumps(body).encode()
    chat = "messages" in body
    req = parse_chat(raw) if chat else parse_completion(raw)
    return plan_request(req, ModelEntry("tiny", {"agg": card(**card_kw)}), None, "tiny", pre, raw)


def refused(body: dict[str, Any], pre: Any, **card_kw: Any) -> BadRequest:
    with pytest.raises(BadRequest) as ei:
        plan(body, pre, **card_kw)
    return ei.value


# --- the rules, with vLLM's words -------------------------------------------------------------------
def _vllm_model_config(vocab: int, max_logprobs: int) -> Any:
    return SimpleNamespace(max_logprobs=max_logprobs, get_vocab_size=lambda: vocab)


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("logprobs", 100), ("logprobs", 2**63),
                                         ("logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", -1)])
def test_logprob_limits_say_what_vllm_says(field: str, value: int) -> None:
    with pytest.raises(VLLMValidationError) as v:
        SamplingParams(**{field: value})._validate_logprobs(_vllm_model_config(VOCAB, 20))
    kind = "sample" if field == "logprobs" else "prompt"
    with pytest.raises(LimitError) as ours:
        check_logprobs(value, LIMITS, field, kind)
    assert str(ours.value) == v.value.args[0] and ours.value.param == v.value.parameter == field


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_token_id_fields_say_what_vllm_says(field: str) -> None:
    ids = [5, VOCAB, -1]
    value: Any = {i: 1.0 for i in ids} if field == "logit_bias" else ids
    check = getattr(SamplingParams(**{field: value}), f"_validate_{field}")
    with pytest.raises(VLLMValidationError) as v:
        check(_vllm_model_config(VOCAB, 20))
    with pytest.raises(LimitError) as ours:
        check_token_ids(ids, LIMITS, field)
    assert str(ours.value) == v.value.args[0] and ours.value.param == field


def test_rules() -> None:
    check_logprobs(20, LIMITS)
    check_logprobs(-1, Limits(vocab_size=VOCAB, max_logprobs=-1))  # -1: up to the whole vocabulary
    with pytest.raises(LimitError, match="non-negative or -1"):
        check_logprobs(-2, LIMITS)
    for k in (-1, 0, 1, VOCAB):
        check_top_k(k, LIMITS)
    with pytest.raises(LimitError, match=r"top_k must be 0 \(disable\), or at least 1, got -2"):
        check_top_k(-2, LIMITS)
    with pytest.raises(LimitError, match=f"at most the vocabulary size \\({VOCAB}\\), got {2**64 + 1}"):
        check_top_k(2**64 + 1, LIMITS)
    with pytest.raises(LimitError, match="at most the vocabulary size \\(2147483647\\)"):
        check_top_k(2**31, Limits())  # an old card: no vocabulary, vLLM's int32 bound
    with pytest.raises(LimitError, match=f"Token id {VOCAB} is out of vocabulary"):
        check_prompt_ids([1, VOCAB, 3], LIMITS)
    with pytest.raises(LimitError, match="Token id -4 is out of vocabulary"):
        check_prompt_ids([-4], LIMITS)
    check_seed(INT64_MAX)
    with pytest.raises(LimitError, match=r"n=2 copies use seed"):
        check_seed(INT64_MAX, fan_out=2)
    with pytest.raises(LimitError, match="seed"):
        check_seed(-(2**63) - 1)


def test_sampling_limits_cover_the_extra_fields() -> None:
    ok = SamplingOptions(max_tokens=8, extra={"logit_bias": {"7": 2.0, 9: -1.0}, "allowed_token_ids": [1, 2],
                                             "prompt_logprobs": 3, "bad_words": ["no"]})
    check_sampling_limits(ok, LIMITS)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"extra": {"logit_bias": {"99999999999999999999999": 1.0}}}, "logit_bias"),
        ({"extra": {"logit_bias": {"x": 1.0}}}, "logit_bias"),
        ({"extra": {"logit_bias": {"1": float("nan")}}}, "logit_bias"),
        ({"extra": {"logit_bias": [1]}}, "logit_bias"),
        ({"extra": {"allowed_token_ids": []}}, "allowed_token_ids"),
        ({"extra": {"allowed_token_ids": [VOCAB]}}, "allowed_token_ids"),
        ({"extra": {"prompt_logprobs": 2**64}}, "prompt_logprobs"),
        ({"extra": {"bad_words": ["w"] * 300}}, "bad_words"),
        ({"extra": {"bad_words": "word"}}, "bad_words"),
    ]
    for kw, param in bad:
        with pytest.raises(LimitError) as ei:
            check_sampling_limits(msgspec.structs.replace(SamplingOptions(max_tokens=8), **kw), LIMITS)
        assert ei.value.param == param, (kw, ei.value)


# --- the frontend -----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "hi", "logprobs": 9223372036854775808}, "logprobs",
     "Requested sample logprobs of 9223372036854775808, which is greater than max allowed: 20"),
    ({"prompt": "hi", "logprobs": 100}, "logprobs",
     "Requested sample logprobs of 100, which is greater than max allowed: 20"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 2**64 + 1}, "top_logprobs",
     "Requested sample logprobs of 18446744073709551617"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "Requested prompt logprobs of 21"),
    ({"prompt": "hi", "top_k": 2**64 + 1}, "top_k", "top_k must be at most the vocabulary size (2048)"),
    ({"prompt": [2**63 + 5]}, "prompt", "Token id 9223372036854775813 is out of vocabulary"),
    ({"prompt": [[1, 2], [3, VOCAB]]}, "prompt", f"Token id {VOCAB} is out of vocabulary"),
    ({"prompt": "hi", "stop_token_ids": [VOCAB]}, "stop_token_ids", "out-of-vocab"),
    ({"prompt": "hi", "logit_bias": {"99999999999999999999999": 1}}, "logit_bias", "out-of-vocab"),
    ({"prompt": "hi", "allowed_token_ids": [2**64]}, "allowed_token_ids", "out-of-vocab"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids is not None and empty!"),
    ({"prompt": "hi", "stop": "x" * 1025}, "stop", "at most 1024 characters"),
    ({"messages": MSG, "stop": ["x" * 2000]}, "stop", "at most 1024 characters"),
    ({"prompt": "hi", "seed": INT64_MAX, "n": 2}, "seed", "n=2 copies"),
    ({"prompt": "hi", "n": 129}, "n", f"between 1 and {MAX_N}"),
    # vLLM's models allow 1024 prompts (VLLM_MAX_COMPLETION_PROMPTS), each fanned out n times
    ({"prompt": [[1]] * 40, "n": 128}, "n", f"at most {MAX_CHOICES}"),
])
def test_frontend_refuses_with_the_field_named(pre: Any, body: dict[str, Any], param: str, words: str) -> None:
    err = refused({"model": "tiny", "max_tokens": 4, **body}, pre)
    assert err.code == 400 and err.kind == "invalid_request_error"
    assert getattr(err, "param", None) == param and words in str(err), (param, str(err))


def test_limits_come_from_the_card(pre: Any) -> None:
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 4, "logprobs": 30, "top_k": 3000}
    assert "max allowed: 20" in str(refused(body, pre))
    p = plan(body, pre, max_logprobs=40, vocab_size=4096)  # a model started with --max-logprobs 40
    assert p.sampling[0].logprobs == 30 and p.sampling[0].top_k == 3000
    assert "Token id 7 is out of vocabulary" in str(refused({**body, "prompt": [7]}, pre, vocab_size=7))
    # a card from before the limits were recorded decodes with vLLM's default and no vocabulary
    old = msgspec.json.decode(msgspec.json.encode(card()).replace(b',"vocab_size":2048', b"")
                              .replace(b',"max_logprobs":20', b""), type=ModelCard)
    assert (old.vocab_size, old.max_logprobs) == (None, 20)


def test_requests_within_the_limits_plan(pre: Any) -> None:
    p = plan({"model": "tiny", "prompt": [0, VOCAB - 1], "max_tokens": 4, "logprobs": 20, "top_k": VOCAB,
              "seed": INT64_MAX, "stop": ["x" * MAX_STOP_CHARS], "logit_bias": {str(VOCAB - 1): 5}}, pre)
    assert p.sampling[0].logprobs == 20 and p.sampling[0].extra["logit_bias"] == {VOCAB - 1: 5.0}
    c = plan({"model": "tiny", "messages": MSG, "max_tokens": 4, "logprobs": True, "top_logprobs": 20,
              "n": 2, "seed": INT64_MAX - 1}, pre)
    assert c.n == 2 and c.sampling[0].logprobs == 20


@pytest.mark.parametrize("messages", [5, None, 1.5, True, "text", {"role": "user"}])
def test_messages_of_another_type_are_a_400(messages: Any) -> None:
    with pytest.raises(BadRequest) as ei:
        parse_chat(json.dumps({"model": "tiny", "messages": messages}).encode())
    assert "messages" in str(ei.value) and getattr(ei.value, "param", None) == "messages"


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
@pytest.mark.parametrize("value", [[], [1], "json", 3, True])
def test_structured_outputs_of_another_type_are_a_400(parse: Any, value: Any) -> None:
    body = {"model": "tiny", "messages": MSG, "prompt": "hi", "structured_outputs": value}
    with pytest.raises(BadRequest) as ei:
        parse(json.dumps(body).encode())
    assert "structured_outputs" in str(ei.value)


@pytest.mark.parametrize("depth", [199, 10_000, 100_000])
def test_deep_nesting_is_a_400_not_a_recursion_error(depth: int) -> None:
    nest = b"[" * depth + b"]" * depth
    for parse, field in ((parse_chat, b"messages"), (parse_completion, b"prompt")):
        with pytest.raises(BadRequest):
            parse(b'{"model":"tiny","' + field + b'":' + nest + b"}")
        with pytest.raises(BadRequest):
            parse(nest)
