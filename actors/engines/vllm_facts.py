"""What a built vLLM AsyncLLM reports about itself, in the Engine protocol's terms: the model's
facts (lengths, KV blocks, vocabulary, EOS ids) and the ZMQ KV-event endpoints of each DP rank.
"""

from __future__ import annotations

from typing import Any

from actors.engines.protocol import KvEventSource, ModelFacts


def model_facts(llm: Any) -> ModelFacts:
    cfg = llm.vllm_config
    mc, cc = cfg.model_config, cfg.cache_config
    eos: list[int] = []
    hf_eos = getattr(mc.hf_config, "eos_token_id", None)
    for tid in hf_eos if isinstance(hf_eos, list) else [hf_eos]:
        if isinstance(tid, int) and tid not in eos:
            eos.append(tid)
    tok = getattr(llm, "tokenizer", None)
    if tok is not None and isinstance(getattr(tok, "eos_token_id", None), int) \
            and tok.eos_token_id not in eos:
        eos.append(tok.eos_token_id)
    return ModelFacts(
        served_model_name=mc.served_model_name or mc.model,
        model_path=mc.model, tokenizer_path=mc.tokenizer or mc.model,
        max_model_len=mc.max_model_len, block_size=cc.block_size,
        total_kv_blocks=int(cc.num_gpu_blocks or 0),
        dp_size=cfg.parallel_config.data_parallel_size,
        hidden_size=mc.get_hidden_size(), vocab_size=mc.get_vocab_size(), eos_token_ids=eos,
        max_logprobs=mc.max_logprobs, input_modalities=input_modalities(mc),
        **pooling_facts(mc),
    )


def pooling_facts(mc: Any) -> dict[str, Any]:
    """A pooling (embedding) model's: its embeddings' length and its Matryoshka dimensions (what a
    request's ``dimensions`` may ask for); nothing for a generative model."""
    if getattr(mc, "runner_type", None) != "pooling":
        return {}
    mds = mc.matryoshka_dimensions
    return {"embedding_size": int(mc.embedding_size), "is_matryoshka": bool(mc.is_matryoshka),
            "matryoshka_dimensions": [int(d) for d in mds] if mds else None}


def input_modalities(mc: Any) -> list[str]:
    """["text"], plus "image" for a model whose vLLM processor takes images (and whose per-prompt
    image limit is not 0: ``limit_mm_per_prompt={"image": 0}`` turns them off)."""
    if not getattr(mc, "is_multimodal_model", False):
        return ["text"]
    mm = getattr(mc, "multimodal_config", None)
    if mm is None:
        return ["text"]
    return ["text"] + (["image"] if mm.get_limit_per_prompt("image") else [])


def kv_event_sources(llm: Any, dp_size: int) -> list[KvEventSource]:
    """One source per DP rank, connectable from this host; none when ZMQ KV events are off."""
    cfg = llm.vllm_config.kv_events_config
    if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
        return []
    try:
        by_rank = dict(llm.get_kv_event_sources())
    except AttributeError:  # older vLLM: no resolved endpoints; compute vLLM's port offsets
        by_rank = {}
    if not by_rank:
        from vllm.distributed.kv_events import ZmqEventPublisher

        for rank in range(dp_size):
            by_rank[rank] = type(cfg)(
                enable_kv_cache_events=True, publisher="zmq", topic=cfg.topic,
                endpoint=ZmqEventPublisher.offset_endpoint_port(cfg.endpoint, rank),
                replay_endpoint=ZmqEventPublisher.offset_endpoint_port(cfg.replay_endpoint, rank))
    return [KvEventSource(dp_rank=rank, endpoint=_connectable(c.endpoint),
                          replay_endpoint=_connectable(c.replay_endpoint) if c.replay_endpoint else None,
                          topic=c.topic)
            for rank, c in sorted(by_rank.items())]


def _connectable(endpoint: str) -> str:
    """A bound endpoint ("tcp://*:5557") as one a subscriber on this host can connect to."""
    return endpoint.replace("*", "127.0.0.1")
