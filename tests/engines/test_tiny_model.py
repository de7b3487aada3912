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
