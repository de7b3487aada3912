"""The tiny local model: files, determinism, caching, tokenizer + chat template, LoRA adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from actors.models import tiny


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", seed=3)


def _tensors(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_files_and_config(built: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (built / name).is_file(), name
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (128, 2, 2048)
    w = _tensors(built / "model.safetensors")
    assert w["model.embed_tokens.weight"].shape == (2048, 128)
    assert w["model.layers.1.self_attn.v_proj.weight"].shape == (64, 128)
    assert str(w["lm_head.weight"].dtype) == "torch.bfloat16"


def test_cached_and_seeded(built: Path, tmp_path: Path) -> None:
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model(built, seed=3) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    same = tiny.ensure_tiny_model(tmp_path / "a", seed=3)
    other = tiny.ensure_tiny_model(tmp_path / "b", seed=4)
    emb = "model.embed_tokens.weight"
    base = _tensors(built / "model.safetensors")[emb]
    assert _tensors(same / "model.safetensors")[emb].equal(base)
    assert not _tensors(other / "model.safetensors")[emb].equal(base)
    # A different seed at the same path rebuilds.
    tiny.ensure_tiny_model(tmp_path / "a", seed=4)
    assert _tensors(tmp_path / "a" / "model.safetensors")[emb].equal(_tensors(other / "model.safetensors")[emb])


def test_default_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_ACTORS_HOME", str(tmp_path))
    assert tiny.tiny_model_dir() == tmp_path / "models" / "tiny-llama"
    assert tiny.identity_lora_dir() == tmp_path / "models" / "tiny-llama-loras" / "identity"


def test_tokenizer_and_chat_template(built: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(built))
    assert len(tok) == 2048
    text = "import os\nprint(os.getcwd())"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False)
    assert rendered == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((built / "generation_config.json").read_text())
    assert tok.eos_token_id in gen["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


def test_lora_adapters(built: Path) -> None:
    lora, ident = tiny.tiny_lora_dir(built), tiny.identity_lora_dir(built)
    for d in (lora, ident):
        cfg = json.loads((d / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == 8
        assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    w = _tensors(lora / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn"
    assert w[f"{key}.q_proj.lora_A.weight"].shape == (8, 128)
    assert w[f"{key}.v_proj.lora_B.weight"].shape == (64, 8)
    assert w[f"{key}.q_proj.lora_B.weight"].abs().sum() > 0
    wi = _tensors(ident / "adapter_model.safetensors")
    assert all(v.abs().sum() == 0 for k, v in wi.items() if "lora_B" in k)
    assert set(wi) == set(w)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def hf_tok(built: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(built))


def test_tag_tokens_are_single_ordinary_tokens(hf_tok) -> None:
    ids = [hf_tok.convert_tokens_to_ids(t) for t in tiny.TAG_TOKENS]
    assert ids == list(range(tiny.VOCAB - 4, tiny.VOCAB))  # inside the embedding table
    assert len(hf_tok) == tiny.VOCAB
    text = f"<think>a plan</think>{CALL}"
    enc = hf_tok(text, add_special_tokens=False).input_ids
    for tag, tid in zip(tiny.TAG_TOKENS, ids, strict=True):
        assert enc.count(tid) == 1, tag
        assert tid not in hf_tok.all_special_ids
    # not special: decoding for the client (skip_special_tokens) keeps them for the parsers
    assert hf_tok.decode(enc, skip_special_tokens=True) == text


def test_chat_template_renders_tools_like_hermes(hf_tok) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    plain = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert plain == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                     "<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n")
    with_tools = hf_tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    head, _, rest = with_tools.partition("<tools>\n")
    tools_json, _, tail = rest.partition("\n</tools>")
    assert head.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.loads(tools_json) == TOOLS[0]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>' \
        in tail
    # the system message went into the tools turn, not a second system turn
    assert with_tools.count("<|im_start|>system") == 1
    assert tail.endswith("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n")

    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function",  # the OpenAI shape: arguments as a JSON string
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function",  # vLLM's: arguments as a dict
             "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Lyon."}]
    rendered = hf_tok.apply_chat_template(history, tools=TOOLS, add_generation_prompt=False, tokenize=False)
    assert rendered.endswith(
        "<|im_start|>assistant\n" + CALL + CALL.replace("Paris", "Lyon").replace("<tool_call>", "\n<tool_call>", 1)
        + "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\nSunny in Paris, rain in Lyon.<|im_end|>\n")


def test_vllm_parsers_work_with_the_tokenizer(hf_tok) -> None:
    pytest.importorskip("vllm")
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    calls = Hermes2ProToolParser(hf_tok).extract_tool_calls(f"{CALL}\n{CALL.replace('Paris', 'Rome')}", None)
    assert calls.tools_called and [json.loads(c.function.arguments)["city"] for c in calls.tool_calls] == \
        ["Paris", "Rome"]

    r1 = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(hf_tok)  # looks the tokens up
    assert (r1.start_token_id, r1.end_token_id) == tuple(hf_tok.convert_tokens_to_ids(["<think>", "</think>"]))
    text = "<think>some reasoning</think>The answer."
    assert r1.extract_reasoning(text, None) == ("some reasoning", "The answer.")
    # streaming decides on token ids: feed the text one token at a time, as an engine emits it
    ids = hf_tok(text, add_special_tokens=False).input_ids
    reasoning = content = ""
    for i in range(len(ids)):
        prev, cur = hf_tok.decode(ids[:i]), hf_tok.decode(ids[:i + 1])
        delta = r1.extract_reasoning_streaming(prev, cur, cur[len(prev):], ids[:i], ids[:i + 1], ids[i:i + 1])
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    assert (reasoning, content) == ("some reasoning", "The answer.")
    qwen3 = ReasoningParserManager.get_reasoning_parser("qwen3")(hf_tok)
    assert qwen3.extract_reasoning(text, None) == ("some reasoning", "The answer.")
