"""What the mocker's requests emit: EngineOutput deltas with text, fake but deterministic logprobs,
and (for the prefill role) NIXL-shaped kv_transfer_params; plus merging of queued deltas."""

from __future__ import annotations

from typing import Any

from actors.engines.mocker import tokens as tk
from actors.engines.mocker.scheduler import MockRequest
from actors.engines.protocol import EngineOutput, SamplingOptions, TokenLogprob


def build(req: MockRequest, toks: list[int], final: bool, *, role: str, engine_id: str,
          vocab_size: int) -> EngineOutput:
    sampling: SamplingOptions = req.sink.sampling
    out = EngineOutput(token_ids=toks, num_prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens or 0)
    if toks and sampling.detokenize:
        detok = req.sink.detok
        out.text = detok.push(toks) if detok is not None else tk.detokenize(toks)
    if toks and sampling.logprobs is not None:
        out.logprobs = [logprob(t, sampling.logprobs, vocab_size) for t in toks]
    if final:
        out.finish_reason = req.finish_reason
        out.stop_reason = req.stop_reason
        if role == "prefill" and req.finish_reason in ("stop", "length"):
            out.kv_transfer_params = transfer_params(req, engine_id)
    return out


def logprob(tok: int, k: int, vocab_size: int) -> TokenLogprob:
    """The sampled token's logprob and the top ``k`` (-1: the whole vocabulary, as vLLM reads it); the
    engine has checked ``k`` against max_logprobs before the request started."""
    if k == -1:
        k = vocab_size
    lp = tk.fake_logprob(tok, 0)
    top = [(tok, lp)] if k > 0 else []
    for j in range(1, k):
        alt = (tok + j * 7919) % vocab_size
        top.append((alt, tk.fake_logprob(alt, j)))
    return TokenLogprob(token_id=tok, logprob=lp, top=top)


def transfer_params(req: MockRequest, engine_id: str) -> dict[str, Any]:
    """NIXL-shaped hand-off description (the blocks themselves are freed at once here)."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [list(req.released_blocks)], "remote_engine_id": engine_id,
        "remote_request_id": req.request_id, "remote_host": "127.0.0.1", "remote_port": 0,
        "remote_num_tokens": len(req.prompt), "tp_size": 1, "transfer_mode": "pull",
        "remote_blocks_expiry_time": None, "remote_prefill_cached_tokens": req.cached_tokens or 0,
    }


def merge(a: EngineOutput, b: EngineOutput) -> EngineOutput:
    """Two queued deltas of one request as one (the consumer was slower than the engine)."""
    out = EngineOutput(token_ids=a.token_ids + b.token_ids, num_prompt_tokens=b.num_prompt_tokens,
                       cached_tokens=b.cached_tokens, finish_reason=b.finish_reason,
                       stop_reason=b.stop_reason, kv_transfer_params=b.kv_transfer_params)
    if a.text is not None or b.text is not None:
        out.text = (a.text or "") + (b.text or "")
    if a.logprobs is not None or b.logprobs is not None:
        out.logprobs = (a.logprobs or []) + (b.logprobs or [])
    return out
