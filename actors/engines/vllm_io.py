"""Requests and outputs between the Engine protocol and vLLM: SamplingOptions → SamplingParams (with
the role's KV hand-off), Prompt → vLLM's prompt dict, RequestOutput → EngineOutput (logprobs kept
as the sampled token plus the top-k), LoraRef → LoRARequest. vLLM is imported where it is used, so
that importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any

from actors.engines.protocol import (
    EngineOutput,
    FinishReason,
    LoraRef,
    MultiModalInput,
    Prompt,
    Role,
    SamplingOptions,
    TextPrompt,
    TokenLogprob,
    TokensPrompt,
)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def sampling_params(s: SamplingOptions, role: Role, kv_transfer_params: dict[str, Any] | None) -> Any:
    """vLLM's SamplingParams for one request (DELTA outputs); ValueError for options it refuses."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    kw: dict[str, Any] = dict(
        n=1, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1, min_p=s.min_p, seed=s.seed,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens, logprobs=s.logprobs, detokenize=s.detokenize,
        output_kind=RequestOutputKind.DELTA,
    )
    if s.structured is not None:
        fields = {k: v for k, v in _struct_items(s.structured) if v is not None}
        kw["structured_outputs"] = StructuredOutputsParams(**fields)
    extra = dict(s.extra)
    if extra.get("logit_bias"):
        # JSON clients of a worker can only send string keys; SamplingParams compares them as ints
        extra["logit_bias"] = {int(k): float(v) for k, v in extra["logit_bias"].items()}
    extra_args = dict(extra.pop("extra_args", None) or {})
    kw.update(extra)
    if role == "prefill":
        # Prefill only computes the prompt's KV; the connector keeps it for the decode engine.
        kw.update(max_tokens=1, min_tokens=0)
        extra_args["kv_transfer_params"] = {**(kv_transfer_params or {}), "do_remote_decode": True}
    elif kv_transfer_params is not None:
        extra_args["kv_transfer_params"] = dict(kv_transfer_params)
    if extra_args:
        kw["extra_args"] = extra_args
    # built fresh per request and never reused: vLLM need not deep-copy it on submission (its own
    # server says the same of its per-request params); the deepcopy was ~4 % of a worker's loop
    kw["skip_clone"] = True
    try:
        return SamplingParams(**kw)
    except TypeError as e:
        raise ValueError(f"bad sampling options: {e}") from e


def vllm_prompt(prompt: Prompt) -> Any:
    if isinstance(prompt, TokensPrompt):
        if prompt.mm is not None:
            return mm_prompt(prompt.token_ids, prompt.mm)
        return {"prompt_token_ids": list(prompt.token_ids)}
    if isinstance(prompt, TextPrompt):
        return {"prompt": prompt.text}
    import torch

    tensor = prompt.tensor if isinstance(prompt.tensor, torch.Tensor) else torch.tensor(prompt.tensor)
    return {"prompt_embeds": tensor}


def mm_prompt(token_ids: list[int], mm: MultiModalInput) -> dict[str, Any]:
    """A multimodal token prompt as vLLM takes it: the unexpanded ids (vLLM's processor expands each
    image's placeholder again, exactly as the frontend's copy of it did), then any migrated
    continuation; the images decoded, named by their content hashes (``multi_modal_uuids``: the
    prefix cache, the KV events and the EC connector's files all use these names)."""
    import io

    from PIL import Image

    from actors.engines.image_decode import to_model_rgb

    images = []
    for i, item in enumerate(mm.images):
        # decoded as the frontend decoded it, so vLLM's processor tiles it as the frontend's copy did
        try:
            images.append(to_model_rgb(Image.open(io.BytesIO(item.data))))
        except Exception as e:  # noqa: BLE001 - a caller other than our frontend sent a bad file
            raise ValueError(f"image {i} cannot be decoded: {e}") from None
    return {"prompt_token_ids": list(mm.source_ids) + list(token_ids[mm.prompt_len:]),
            "multi_modal_data": {"image": images},
            "multi_modal_uuids": {"image": [item.uuid for item in mm.images]}}


def engine_output(out: Any, first: bool, sampling: SamplingOptions) -> EngineOutput:
    """One DELTA RequestOutput as an EngineOutput; prompt length on the first, cache hits on the
    first and the last, finish details on the last."""
    co = out.outputs[0] if out.outputs else None
    eo = EngineOutput(token_ids=list(co.token_ids) if co else [])
    if co is not None and sampling.detokenize:
        eo.text = co.text
    if co is not None and sampling.logprobs is not None and co.logprobs:
        eo.logprobs = _logprobs(co.token_ids, co.logprobs, sampling.logprobs)
    if first and out.prompt_token_ids is not None:
        eo.num_prompt_tokens = len(out.prompt_token_ids)
    if first or out.finished:
        eo.cached_tokens = out.num_cached_tokens
    if out.finished:
        reason = co.finish_reason if co is not None else "abort"
        eo.finish_reason = _FINISH.get(reason or "stop", "stop")
        eo.stop_reason = co.stop_reason if co is not None else None
        eo.kv_transfer_params = out.kv_transfer_params
    return eo


def lora_request(lora: LoraRef | None) -> Any:
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora.name, lora.int_id, lora.path)


def _struct_items(struct: Any) -> list[tuple[str, Any]]:
    return [(f, getattr(struct, f)) for f in struct.__struct_fields__]


def _logprobs(token_ids: Any, per_token: Any, k: int) -> list[TokenLogprob]:
    """vLLM gives one {token_id: Logprob(logprob, rank, ...)} per generated token; keep the sampled
    token's logprob and the top-k alternatives by rank (the sampled one included if it is top-k; k = -1:
    all of them, as vLLM reads it)."""
    result = []
    for tid, entries in zip(token_ids, per_token, strict=False):
        entries = dict(entries or {})
        chosen = entries.get(tid)
        top = sorted(((t, lp) for t, lp in entries.items() if lp.rank is not None and (k < 0 or lp.rank <= k)),
                     key=lambda item: item[1].rank)
        result.append(TokenLogprob(token_id=tid, logprob=float(chosen.logprob) if chosen else float("nan"),
                                   top=[(t, float(lp.logprob)) for t, lp in top]))
    return result
