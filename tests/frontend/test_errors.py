"""Bad requests: each gets the right HTTP status and an OpenAI-shaped error body."""

from __future__ import annotations

import json
from typing import Any

import pytest

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def agg(deploy: Any) -> Any:
    await deploy.worker()
    await deploy.start_frontend(max_body_bytes=4096)
    await deploy.wait_ready(1)
    return deploy


CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body, status, param substring expected in message or None)
    ("malformed-json", CHAT, b"{not json", 400, None),
    ("messages-missing", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages-empty", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    # vLLM's message normalizer runs list() over it before pydantic looks: a TypeError, a 500 before
    ("tool-calls-not-iterable", CHAT, {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": True}]},
     400, "tool_calls"),
    ("unknown-model", CHAT, {"model": "nope", "messages": MSG}, 404, "nope"),
    ("temperature-negative", CHAT, {"model": MODEL, "messages": MSG, "temperature": -1}, 400, "temperature"),
    ("top-p-zero", CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("n-zero", COMPL, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("max-tokens-over-context", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 5000}, 400,
     "maximum context length"),
    ("prompt-over-context", COMPL, {"model": MODEL, "prompt": [1] * 1100, "max_tokens": 1}, 400,
     "maximum context length"),
    ("top-logprobs-without-logprobs", CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400,
     "logprobs"),
    ("stream-options-without-stream", CHAT, {"model": MODEL, "messages": MSG,
                                             "stream_options": {"include_usage": True}}, 400, "stream"),
    ("prompt-missing", COMPL, {"model": MODEL}, 400, "prompt"),
    ("prompt-wrong-type", COMPL, {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("json-schema-missing", CHAT, {"model": MODEL, "messages": MSG,
                                   "response_format": {"type": "json_schema"}}, 400, "json_schema"),
    ("image-content", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "does not take images"),
    ("body-too-large", COMPL, {"model": MODEL, "prompt": "x" * 5000}, 413, "limit"),
    ("client-kv-transfer-params", COMPL, {"model": MODEL, "prompt": "x",
                                          "kv_transfer_params": {"a": 1}}, 400, "kv_transfer_params"),
    ("unknown-route", "/v1/audio/transcriptions", {"model": MODEL}, 404, None),
    ("pinned-unknown-worker", COMPL, {"model": MODEL, "prompt": "x", "max_tokens": 1}, 404, "nosuch"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_bad_request(agg: Any, http: Any, case: tuple) -> None:
    name, path, body, status, needle = case
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if name == "pinned-unknown-worker":
        headers["x-worker-instance-id"] = "nosuch"
    async with http.post(agg.url + path, data=data, headers=headers) as r:
        assert r.status == status, await r.text()
        assert r.headers["Content-Type"].startswith("application/json")
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error",
                           413: "invalid_request_error"}[status]
    if needle:
        assert needle in err["message"] or needle == err["param"], err
    assert not agg.workers[0].requests  # nothing bad reached a worker


async def test_api_key(deploy: Any, http: Any) -> None:
    await deploy.worker()
    await deploy.start_frontend(api_key="sekret")
    await deploy.wait_ready(1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    async with http.post(deploy.url + COMPL, json=body) as r:
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
    async with http.post(deploy.url + COMPL, json=body, headers={"Authorization": "Bearer wrong"}) as r:
        assert r.status == 401
    async with http.post(deploy.url + COMPL, json=body, headers={"Authorization": "Bearer sekret"}) as r:
        assert r.status == 200
    async with http.get(deploy.url + "/health") as r:  # probes stay open
        assert r.status == 200


async def test_api_key_from_file_or_env_and_protected_metrics(deploy: Any, http: Any, tmp_path: Any,
                                                               monkeypatch: Any) -> None:
    """The key comes from a file (or an environment variable); with metrics_auth /metrics needs it
    too, while /health and /live stay open."""
    key_file = tmp_path / "api.key"
    key_file.write_text("from-file\n")
    await deploy.worker()
    await deploy.start_frontend(api_key_file=str(key_file), metrics_auth=True)
    await deploy.wait_ready(1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    async with http.post(deploy.url + COMPL, json=body, headers={"Authorization": "Bearer from-file"}) as r:
        assert r.status == 200
    async with http.post(deploy.url + COMPL, json=body, headers={"Authorization": "Bearer from-fil"}) as r:
        assert r.status == 401
    async with http.get(deploy.url + "/metrics") as r:
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
    async with http.get(deploy.url + "/metrics", headers={"Authorization": "Bearer from-file"}) as r:
        assert r.status == 200
    for probe in ("/health", "/live"):
        async with http.get(deploy.url + probe) as r:
            assert r.status == 200, probe
    await deploy.frontend.stop(5)

    monkeypatch.setenv("TEST_FRONTEND_KEY", "from-env")
    await deploy.start_frontend(api_key_env="TEST_FRONTEND_KEY")
    await deploy.wait_ready(1)
    async with http.post(deploy.url + COMPL, json=body, headers={"Authorization": "Bearer from-env"}) as r:
        assert r.status == 200
    async with http.post(deploy.url + COMPL, json=body, headers={"Authorization": "Bearer from-file"}) as r:
        assert r.status == 401
    async with http.get(deploy.url + "/metrics") as r:  # metrics_auth off: open
        assert r.status == 200


async def test_no_capacity_is_503(deploy: Any, http: Any) -> None:
    await deploy.worker(role="prefill", pool="prefill")  # a model whose only pool is prefill
    await deploy.start_frontend()
    for _ in range(100):
        if deploy.frontend.workers.models:
            break
        import asyncio
        await asyncio.sleep(0.05)
    async with http.post(deploy.url + COMPL, json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1}) as r:
        assert r.status == 503, await r.text()
        assert (await r.json())["error"]["type"] == "service_unavailable"
