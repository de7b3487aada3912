"""An identity LoRA adapter (lora_B = 0) for any Llama-style model, built from its HF config.

Why: on vLLM-CPU, when every LoRA slot is full, base-model rows of a batch that mixes base and
adapter requests pick up the *last* slot's adapter (the CPU torch LoRA ops index slot -1 for "no
adapter"; vllm PRs #48421/#49656 are open). Sending base traffic through an adapter whose
``lora_B`` is zero gives exactly the base model's output and leaves no row at index -1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from config.paths import vllm_actors_home

log = logging.getLogger(__name__)

IDENTITY_LORA_NAME = "__base_identity__"
IDENTITY_LORA_ID = 2**31 - 1  # far from the LoRA manager's ids (they count up from 1)
TARGETS = ("q_proj", "v_proj")


def _shape(hf_config: Any) -> dict[str, int]:
    def get(name: str, default: int | None = None) -> int:
        value = getattr(hf_config, name, None)
        if value is None:
            if default is None:
                raise ValueError(f"model config has no {name}: cannot build an identity adapter")
            return default
        return int(value)

    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    head_dim = get("head_dim", hidden // heads)
    return {"layers": get("num_hidden_layers"), "hidden": hidden, "q_out": heads * head_dim,
            "v_out": get("num_key_value_heads", heads) * head_dim}


def ensure_identity_adapter(hf_config: Any, rank: int, root: str | Path | None = None) -> Path:
    """Directory of a PEFT identity adapter for ``hf_config`` (cached by shape and rank)."""
    import torch
    from safetensors.torch import save_file

    shape = _shape(hf_config)
    key = hashlib.sha256(json.dumps({**shape, "rank": rank}, sort_keys=True).encode()).hexdigest()[:16]
    base = Path(root).expanduser() if root else vllm_actors_home()
    out = base / "identity-loras" / key
    if (out / "adapter_model.safetensors").is_file():
        return out
    tmp = out.with_name(f"{key}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(shape["layers"]):
        for target, out_dim in (("q_proj", shape["q_out"]), ("v_proj", shape["v_out"])):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(rank, shape["hidden"])
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(out_dim, rank)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(TARGETS), "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "inference_mode": True}))
    try:
        tmp.rename(out)
    except OSError:  # another process built it meanwhile
        pass
    log.info("built identity LoRA adapter %s (rank %d) for base requests", out, rank)
    return out
