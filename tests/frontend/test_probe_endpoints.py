"""The endpoints clients probe besides generation: GET /v1/models/{id} (through the official openai
client), POST /tokenize and POST /detokenize (vLLM's shapes, checked against the tokenizer's own
encode/apply_chat_template/decode), against scripted workers on real NATS (tests/frontend/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from actors.frontend.actor import FrontendActor
from actors.worker.contract import LoraRecord
from bus.registry import Registry
from config.topology import FrontendConfig, ModelConfig, PoolConfig
from tests.frontend.conftest import CONTEXT, Deployment
from tests.helpers import eventually, openai_client

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                         "parameters": {"type": "object", "properties": {
                                             "a": {"type": "number"}, "b": {"type": "number"}},
                                             "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def hf(tiny_dir: str) -> Any:
    """The reference: transformers' own tokenizer of the tiny model."""
    return AutoTokenizer.from_pretrained(tiny_dir)


async def _lora(bus: Any, worker: Any, name: str) -> Registry:
    """Record adapter ``name`` as loaded on ``worker`` (what the LoRA actor writes)."""
    loras = Registry(bus.js, bus.subjects.bucket_loras, 10.0)
    await loras.ensure()
    await loras.put(f"{worker.instance}.{name}", LoraRecord(lora_name=name, lora_id=1, path="/x", uri="file:///x",
                                                            instance=worker.instance, model=MODEL))
    return loras


@pytest.fixture
async def agg(deploy: Deployment, bus: Any) -> AsyncIterator[Deployment]:
    """One scripted worker with two adapters, one with an HF-style name holding a '/'."""
    w = await deploy.worker()
    loras = await _lora(bus, w, "tiny-lora")
    await _lora(bus, w, "org/tiny-lora")
    await deploy.start_frontend(trust_request_chat_template=True)  # the template variants send their own
    await deploy.wait_ready(1)
    assert deploy.frontend is not None
    await eventually(lambda: {"tiny-lora", "org/tiny-lora"} <= set(deploy.frontend.workers.loras))
    try:
        yield deploy
    finally:
        await loras.close()


async def _post(http: Any, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    kwargs = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
    async with http.post(url, **kwargs, **kw) as r:
        return r.status, await r.json()


# --- GET /v1/models/{id} ----------------------------------------------------------------------------
async def test_models_retrieve(agg: Deployment, tiny_dir: str, http: Any) -> None:
    c = openai_client(agg.url)
    m = await c.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "vllm-actors")
    assert m.root == tiny_dir and m.model_extra["max_model_len"] == CONTEXT
    listed = {x.id: x for x in (await c.models.list()).data}
    assert sorted(listed) == ["org/tiny-lora", "tiny", "tiny-lora"]
    for name in listed:  # the same object /v1/models lists (its "created" is the time of asking)
        got = await c.models.retrieve(name)
        assert got.model_dump(exclude={"created"}) == listed[name].model_dump(exclude={"created"})
    lora = await c.models.retrieve("tiny-lora")
    assert (lora.id, lora.root, lora.model_extra["parent"]) == ("tiny-lora", "tiny-lora", MODEL)
    # the client sends the '/' as %2F; a raw '/' in the path reaches the same adapter
    assert (await c.models.retrieve("org/tiny-lora")).model_extra["parent"] == MODEL
    async with http.get(agg.url + "/v1/models/org/tiny-lora") as r:
        assert r.status == 200 and (await r.json())["id"] == "org/tiny-lora"
    with pytest.raises(openai.NotFoundError) as ei:
        await c.models.retrieve("nosuch")
    err = ei.value.body
    assert err["message"] == "The model `nosuch` does not exist." and err["type"] == "not_found_error"
    assert err["param"] == "model" and err["code"] == 404


async def test_models_retrieve_while_not_ready(bus: Any, deploy: Deployment, tiny_dir: str, http: Any) -> None:
    """Before any worker, the topology's model is "not ready yet" (503 + Retry-After), as chat
    answers, while an unknown id is a 404. With one worker of a pool of two the model is servable
    (chat and /tokenize serve it) but the deployment is not ready: /v1/models lists nothing, and
    retrieve agrees with it (503), not with chat."""
    fe = FrontendActor(bus.child(), config=FrontendConfig(http="127.0.0.1:0"),
                       model_config=ModelConfig(name=MODEL, path=tiny_dir),
                       pools={"agg": PoolConfig(engine="mocker", replicas=2)})
    await fe.start()
    try:
        c = openai_client(f"http://127.0.0.1:{fe.port}")
        with pytest.raises(openai.APIStatusError) as ei:
            await c.models.retrieve(MODEL)
        assert ei.value.status_code == 503 and ei.value.response.headers["Retry-After"]
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("nosuch")
        await deploy.worker()
        await eventually(lambda: MODEL in fe.workers.models, timeout=15)
        assert (await c.models.list()).data == []
        with pytest.raises(openai.APIStatusError) as ei:
            await c.models.retrieve(MODEL)
        assert ei.value.status_code == 503 and "not ready" in ei.value.message
        status, body = await _post(http, f"http://127.0.0.1:{fe.port}/tokenize", {"model": MODEL, "prompt": "hi"})
        assert status == 200 and body["count"] > 0
    finally:
        await fe.stop(1.0)


# --- POST /tokenize, /detokenize ----------------------------------------------------------------------
@pytest.mark.parametrize("special", [None, True, False])
async def test_tokenize_prompt_form(agg: Deployment, hf: Any, http: Any, special: bool | None) -> None:
    text = "Hello world, tokenize me: <think> and <|im_end|> too."
    body: dict[str, Any] = {"model": MODEL, "prompt": text}
    if special is not None:
        body["add_special_tokens"] = special
    status, r = await _post(http, agg.url + "/tokenize", body)
    assert status == 200, r
    want = hf.encode(text, add_special_tokens=special is not False)  # vLLM's default: true
    assert r == {"count": len(want), "max_model_len": CONTEXT, "tokens": want, "token_strs": None}
    assert (want[0] == hf.bos_token_id) == (special is not False)


async def test_tokenize_token_strs_and_defaults(agg: Deployment, hf: Any, http: Any) -> None:
    text = "Hello world"
    status, r = await _post(http, agg.url + "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200, r  # no model named: the only one
    assert r["tokens"] == hf.encode(text)
    assert r["token_strs"] == hf.convert_ids_to_tokens(r["tokens"]) and "Ġworld" in "".join(r["token_strs"])
    for name in ("tiny-lora", "org/tiny-lora"):  # an adapter tokenizes with its base model's tokenizer
        status, r2 = await _post(http, agg.url + "/tokenize", {"model": name, "prompt": text})
        assert status == 200 and r2["tokens"] == r["tokens"]


@pytest.mark.parametrize("variant", ["default", "no_generation_prompt", "continue_final", "special", "tools",
                                     "template_kwargs"])
async def test_tokenize_chat_form(agg: Deployment, hf: Any, http: Any, variant: str) -> None:
    messages: list[dict[str, Any]] = list(MESSAGES)
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    kw: dict[str, Any] = {"add_generation_prompt": True}
    if variant == "no_generation_prompt":
        body["add_generation_prompt"] = kw["add_generation_prompt"] = False
    elif variant == "continue_final":
        messages.append({"role": "assistant", "content": "It is"})
        body.update(add_generation_prompt=False, continue_final_message=True)
        kw = {"add_generation_prompt": False, "continue_final_message": True}
    elif variant == "tools":
        body["tools"] = [TOOL]
        kw["tools"] = [TOOL]
    elif variant == "template_kwargs":
        # a request's own template, with a variable it reads from chat_template_kwargs
        template = "{{ bos_token }}{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        body.update(chat_template=template, chat_template_kwargs={"greeting": "Hi!"})
        kw.update(chat_template=template, greeting="Hi!")
    status, r = await _post(http, agg.url + "/tokenize", {**body, "add_special_tokens": True}
                            if variant == "special" else body)
    assert status == 200, r
    if variant == "special":  # on top of what the template adds (vLLM's chat default is false)
        want = hf.encode(hf.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=True)
        assert want[:2] == [hf.bos_token_id] * 2
    else:
        want = hf.apply_chat_template(messages, tokenize=True, **kw)["input_ids"]
    assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == CONTEXT
    if variant == "tools":
        assert "<tools>" in hf.decode(want)


async def test_tokenize_chat_equals_what_a_chat_request_sends(agg: Deployment, http: Any) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL]}
    status, r = await _post(http, agg.url + "/tokenize", body)
    assert status == 200, r
    # "none": the tools reach the template only (this model has no tool-call parser for "auto")
    await openai_client(agg.url).chat.completions.create(**body, tool_choice="none", max_tokens=1)
    assert list(agg.workers[0].requests[-1].token_ids or []) == r["tokens"]


class _RawRequest:
    """What vLLM's serving class reads of the HTTP request (a request id header, if any)."""

    headers: dict[str, str] = {}


@pytest.fixture(scope="module")
def vllm_tokenization(tiny_dir: str) -> Any:
    """vLLM's own /tokenize and /detokenize logic (``ServingTokenization``) for the tiny model, built
    as ``vllm serve`` builds it, without an engine: the reference for the parity test."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    cfg = EngineArgs(model=tiny_dir, served_model_name=[MODEL], max_model_len=CONTEXT).create_engine_config()
    online = OnlineRenderer(cfg.model_config, renderer_from_config(cfg), request_logger=None, chat_template=None,
                            chat_template_content_format="auto")
    models = OpenAIModelRegistry(model_config=cfg.model_config,
                                 base_model_paths=[BaseModelPath(name=MODEL, model_path=tiny_dir)])
    return ServingTokenization(models, online, chat_template=None, chat_template_content_format="auto")


async def test_same_answers_as_vllm_serve(agg: Deployment, vllm_tokenization: Any, http: Any) -> None:
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

    from actors.frontend.tokenize_api import parse_tokenize

    bare_tool = {"type": "function", "function": {"name": "now"}}  # no description, no parameters
    tokenize = [
        {"model": MODEL, "prompt": "Hello <think>world</think>"},
        {"model": MODEL, "prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True},
        {"model": MODEL, "messages": MESSAGES, "return_token_strs": True},
        {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False, "add_special_tokens": True},
        {"model": MODEL, "messages": [*MESSAGES, {"role": "assistant", "content": "It is"}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"model": MODEL, "messages": MESSAGES, "tools": [TOOL, bare_tool]},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}]},
    ]
    for body in tokenize:
        status, ours = await _post(http, agg.url + "/tokenize", body)
        assert status == 200, ours
        theirs = await vllm_tokenization.create_tokenize(parse_tokenize(json.dumps(body).encode()), _RawRequest())
        assert ours == theirs.model_dump(), body
        status, ours = await _post(http, agg.url + "/detokenize", {"model": MODEL, "tokens": ours["tokens"]})
        theirs = await vllm_tokenization.create_detokenize(DetokenizeRequest(model=MODEL, tokens=theirs.tokens),
                                                           _RawRequest())
        assert status == 200 and ours == theirs.model_dump(), body


async def test_detokenize_round_trip(agg: Deployment, hf: Any, http: Any) -> None:
    text = "Round trip: <tool_call>{\"a\": 1}</tool_call> done."
    for special in (False, True):
        _, tok = await _post(http, agg.url + "/tokenize", {"prompt": text, "add_special_tokens": special})
        status, r = await _post(http, agg.url + "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
        assert status == 200, r
        # special tokens are kept, as the tokenizer's decode (and vLLM's /detokenize) keep them
        assert r == {"prompt": hf.decode(tok["tokens"])}
        assert r["prompt"] == (hf.bos_token + text if special else text)
    _, chat = await _post(http, agg.url + "/tokenize", {"messages": MESSAGES})
    _, r = await _post(http, agg.url + "/detokenize", {"tokens": chat["tokens"]})
    assert r["prompt"] == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    _, r = await _post(http, agg.url + "/detokenize", {"model": "tiny-lora", "tokens": []})
    assert r == {"prompt": ""}


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", b"not json", None),
    ("/tokenize", b"[1, 2]", None),
    ("/tokenize", b"{}", "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "sometimes"}, "add_special_tokens"),
    ("/tokenize", {"messages": "hello"}, "messages"),
    ("/tokenize", {"messages": None}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "image_url"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{% for %}"}, "chat template"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", b"", None),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2048]}, "out of vocabulary"),
    ("/detokenize", {"tokens": [2**63 - 1]}, "out of vocabulary"),
    ("/detokenize", {"tokens": [2**64]}, "tokens"),
])
async def test_bad_bodies_are_openai_400s(agg: Deployment, http: Any, path: str, body: Any,
                                          needle: str | None) -> None:
    status, r = await _post(http, agg.url + path, body, headers={"Content-Type": "application/json"})
    assert status == 400, r
    err = r["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"]
    if needle:
        assert needle in err["message"] or needle == err["param"], err


async def test_unknown_model_404_and_body_limit(deploy: Deployment, http: Any) -> None:
    await deploy.worker()
    await deploy.start_frontend(max_body_bytes=4096)
    await deploy.wait_ready(1)
    for path, body in (("/tokenize", {"model": "nosuch", "prompt": "x"}),
                       ("/detokenize", {"model": "nosuch", "tokens": [1]})):
        status, r = await _post(http, deploy.url + path, body)
        assert status == 404 and r["error"]["message"] == "The model `nosuch` does not exist.", r
    status, r = await _post(http, deploy.url + "/tokenize", {"prompt": "x" * 5000})
    assert status == 413 and r["error"]["type"] == "invalid_request_error", r


async def test_api_key_guards_probe_endpoints(deploy: Deployment, http: Any) -> None:
    await deploy.worker()
    await deploy.start_frontend(api_key="sekret")
    await deploy.wait_ready(1)
    calls = (("post", "/tokenize", {"prompt": "x"}), ("post", "/detokenize", {"tokens": [1]}),
             ("get", "/v1/models/tiny", None))
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with http.request(method, deploy.url + path, json=body, headers=headers) as r:
                err = (await r.json())["error"]
                assert r.status == 401 and err["type"] == "authentication_error", (path, headers)
        async with http.request(method, deploy.url + path, json=body,
                                headers={"Authorization": "Bearer sekret"}) as r:
            assert r.status == 200, (path, await r.text())
    with pytest.raises(openai.AuthenticationError):
        await openai_client(deploy.url, api_key="wrong").models.retrieve(MODEL)
    assert (await openai_client(deploy.url, api_key="sekret").models.retrieve(MODEL)).id == MODEL
    for probe in ("/health", "/live"):  # probes stay open
        async with http.get(deploy.url + probe) as r:
            assert r.status == 200, probe


async def test_text_mode_model_refuses_tokenize(deploy: Deployment, tiny_dir: str, http: Any) -> None:
    await deploy.worker()
    await deploy.start_frontend(model_config=ModelConfig(name=MODEL, path=tiny_dir, text_mode=True))
    assert deploy.frontend is not None
    await eventually(lambda: MODEL in deploy.frontend.workers.models, timeout=15)
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, r = await _post(http, deploy.url + path, body)
        assert status == 400 and "text mode" in r["error"]["message"], r
