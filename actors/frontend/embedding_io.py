"""/v1/embeddings' request and response, apart from sending the inputs to workers
(``actors.frontend.embeddings``): vLLM's request model parsed and checked against the model card's
facts (``_CardModel``), each input tokenized into an ``EmbedPlan``, and the replies shaped as vLLM's
``EmbeddingResponse`` (float lists or base64) or its binary bodies (``bytes``, ``bytes_only``).
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pydantic
from vllm import PoolingParams
from vllm.entrypoints.pooling.embed.protocol import (
    EmbeddingBatchChatRequest,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    EmbeddingRequest,
)
from vllm.exceptions import VLLMValidationError

from actors.worker.contract import EmbedReply
from bus.errors import BadRequest

from .discovery import ModelEntry
from .limits import card_limits, check_prompt
from .media import has_media
from .openai_io import as_bad_request, check_request_template, encode_json, validate_json
from .preprocess import Preprocessor

# inputs of one request: OpenAI's limit. vllm serve sets none, but an 8 MiB body of one-token
# inputs is two million of them, each a worker request and a vector in one JSON answer
MAX_INPUTS = 2048
# vLLM's request model is a union (text/token inputs, or chats); one adapter, built once
_REQUEST = pydantic.TypeAdapter(EmbeddingRequest)


@dataclass(frozen=True)
class _CardModel:
    """The parts of vLLM's ``ModelConfig`` its pooling checks read (``PoolingParams.verify``,
    ``build_tok_params``), from the model card: the frontend has no engine config."""

    served_model_name: str
    max_model_len: int
    embedding_size: int
    is_matryoshka: bool
    matryoshka_dimensions: list[int] | None
    pooler_config: None = None  # the pooler's defaults are merged again by the engine
    encoder_config: None = None


EmbedInput = EmbeddingCompletionRequest | EmbeddingChatRequest | EmbeddingBatchChatRequest


def parse_embedding(body: bytes) -> EmbedInput:
    """``body`` as vLLM's EmbeddingRequest (text or token inputs; a chat, or a list of chats, in
    ``messages`` or ``input``); a 400 naming the field otherwise."""
    try:
        req = _REQUEST.validate_json(body)
    except (pydantic.ValidationError, ValueError, VLLMValidationError, TypeError, AttributeError) as e:
        # the union's errors name every member it tried; the member the body meant (a chat when
        # it has messages, else text or token inputs) says what it got wrong (validate_json
        # raises that as a 400)
        validate_json(EmbeddingChatRequest if b'"messages"' in body else EmbeddingCompletionRequest, body)
        if isinstance(e, TypeError | AttributeError):
            # one of vLLM's "before" validators read a field before its type was checked (a chat
            # member's messages): the input's fault, as openai_io treats the chat model's
            raise BadRequest(f"invalid request: {e}") from None
        raise as_bad_request(e) from None
    return req  # type: ignore[no-any-return]


@dataclass
class EmbedPlan:
    entry: ModelEntry
    model: str  # as the client named it
    prompts: list[list[int]]
    dimensions: int | None
    use_activation: bool | None
    encoding_format: str
    embed_dtype: str
    endianness: str
    request_id: str = field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")


def plan_embedding(req: EmbedInput, entry: ModelEntry, name: str, pre: Preprocessor | None,
                   trust_request_chat_template: bool = False) -> EmbedPlan:
    """The inputs as token ids, checked as vllm serve checks them (no NATS, no HTTP). A chat is
    rendered with the model's chat template (or the request's own, where the topology trusts
    request templates) and embedded as one prompt."""
    if not entry.embeds:
        raise BadRequest(f"The model does not support Embeddings API (model {entry.name} generates: its "
                         "pools are not embed pools)", param="model")
    if pre is None:
        raise BadRequest(f"model {entry.name} runs in text mode: /v1/embeddings needs the frontend's "
                         "tokenizer (unset model.text_mode)", param="input")
    card = entry.card
    model = _CardModel(served_model_name=entry.name, max_model_len=card.context_length,
                       embedding_size=card.embedding_size or 0, is_matryoshka=card.is_matryoshka,
                       matryoshka_dimensions=card.matryoshka_dimensions)
    try:
        PoolingParams(task="embed", dimensions=req.dimensions,
                      use_activation=req.use_activation).verify(model)  # type: ignore[arg-type]
        tok = req.build_tok_params(model)  # type: ignore[arg-type]
    except (ValueError, VLLMValidationError) as e:
        raise as_bad_request(e) from None
    items: list[str | list[int]]
    if isinstance(req, EmbeddingCompletionRequest):
        raw = req.input
        if isinstance(raw, str):
            items = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
    else:
        check_request_template(req.chat_template, trust_request_chat_template)
        chats = [req.messages] if isinstance(req, EmbeddingChatRequest) else list(req.messages)
        items = [_render(pre, req, list(chat)) for chat in chats]
    if not items:
        raise BadRequest("You must pass at least one prompt", param="input")
    if len(items) > MAX_INPUTS:
        raise BadRequest(f"input holds {len(items)} inputs; at most {MAX_INPUTS} are embedded in one request",
                         param="input")
    limits = card_limits(card)
    prompts: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            ids = pre.encode(item, tok.add_special_tokens)
        else:
            ids = list(item)
            check_prompt(ids, limits, False)
        try:
            ids = tok.apply_post_tokenization(pre.hf, {"prompt_token_ids": ids})["prompt_token_ids"]
        except (ValueError, VLLMValidationError) as e:
            raise as_bad_request(e) from None
        if not ids:
            raise BadRequest("an input has no tokens: an embedding needs at least one", param="input")
        prompts.append(ids)
    return EmbedPlan(entry=entry, model=name, prompts=prompts, dimensions=req.dimensions,
                     use_activation=req.use_activation, encoding_format=req.encoding_format,
                     embed_dtype=req.embed_dtype, endianness=req.endianness)


def _render(pre: Preprocessor, req: EmbeddingChatRequest | EmbeddingBatchChatRequest,
            messages: list[Any]) -> list[int]:
    """A chat's prompt ids: rendered as a chat completion's prompt is, encoded with the request's
    ``add_special_tokens`` (vLLM's chat default: false, the template writes them)."""
    if has_media(messages):
        raise BadRequest("only text chats are embedded here (no images)", param="messages")
    text = pre.render_chat(messages, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                           template_kwargs=req.chat_template_kwargs)
    return pre.encode(text, req.add_special_tokens)


def shape_response(plan: EmbedPlan, replies: Sequence[EmbedReply], created: int | None = None) -> dict[str, Any]:
    """vLLM's EmbeddingResponse, as a dict for the JSON encoder."""
    data = [{"index": i, "object": "embedding", "embedding": _encoded(plan, r.embedding)}
            for i, r in enumerate(replies)]
    tokens = sum(r.prompt_tokens for r in replies)
    return {"id": plan.request_id, "object": "list", "created": created or int(time.time()),
            "model": plan.model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def binary_response(plan: EmbedPlan, replies: Sequence[EmbedReply], created: int | None = None
                    ) -> tuple[bytes, dict[str, str]]:
    """``encoding_format`` "bytes" (the embeddings back to back, what each is in a ``metadata``
    header) or "bytes_only" (no header), as vLLM's ``build_pooling_bytes_streaming_response``."""
    chunks = [_binary(plan, r.embedding) for r in replies]
    if plan.encoding_format == "bytes_only":
        return b"".join(chunks), {}
    items, offset = [], 0
    for i, (chunk, r) in enumerate(zip(chunks, replies, strict=True)):
        items.append({"index": i, "embed_dtype": plan.embed_dtype, "endianness": plan.endianness,
                      "start": offset, "end": offset + len(chunk), "shape": [len(r.embedding) // 4]})
        offset += len(chunk)
    tokens = sum(r.prompt_tokens for r in replies)
    meta = {"id": plan.request_id, "created": created or int(time.time()), "model": plan.model, "data": items,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return b"".join(chunks), {"metadata": encode_json(meta).decode()}


def _binary(plan: EmbedPlan, raw: bytes) -> bytes:
    """One embedding in the request's ``embed_dtype`` and ``endianness`` (vLLM's tensor2binary)."""
    if plan.embed_dtype == "float32" and (plan.endianness == "little"
                                          or (plan.endianness == "native" and sys.byteorder == "little")):
        return raw  # the worker's bytes are this encoding already
    import torch
    from vllm.utils.serial_utils import tensor2binary

    tensor = torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32))
    return tensor2binary(tensor, plan.embed_dtype, plan.endianness)  # type: ignore[arg-type]


def _encoded(plan: EmbedPlan, raw: bytes) -> list[float] | str:
    if plan.encoding_format == "float":
        return np.frombuffer(raw, dtype="<f4").tolist()
    return base64.b64encode(_binary(plan, raw)).decode()
