"""Anthropic's Messages API (POST /v1/messages) as a chat completion, with vLLM's own translation.

The request is validated by vLLM's ``AnthropicMessagesRequest`` and translated by
``AnthropicServingMessages.to_chat_completion_request`` (system, content blocks, images,
``tool_use``/``tool_result``, ``stop_sequences``, thinking, tool choice); the chat completion's body
and SSE frames go back through the same class's converters (``message_start`` …
``content_block_delta`` … ``message_stop``). So the fields and their meaning are ``vllm serve``'s.
Errors are Anthropic's shape (``anthropic_error``), which the ``anthropic`` client reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse

from bus.errors import ActorError, BadRequest

from .openai_io import as_bad_request, check_chat, encode_json, validate_json
from .planning import Plan

ENDPOINT = "messages"
PATH = "/v1/messages"

# vLLM's converters read nothing of their instance (checked for vLLM 0.32: the request and response
# translations are classmethods or use only their arguments), and its __init__ wants an engine
# client: one bare instance serves them all.
_CONVERTER = AnthropicServingMessages.__new__(AnthropicServingMessages)

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); a status not
# listed is an api_error
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error(err: ActorError) -> bytes:
    """``err`` as Anthropic's error body."""
    kind = _ERROR_TYPES.get(err.code, "invalid_request_error" if 400 <= err.code < 500 else "api_error")
    return encode_json({"type": "error", "error": {"type": kind, "message": err.message}})


def count_request(body: bytes) -> ChatCompletionRequest:
    """A /v1/messages/count_tokens body as the chat request whose prompt it counts."""
    req: AnthropicCountTokensRequest = validate_json(AnthropicCountTokensRequest, body)
    if not req.messages:
        raise BadRequest("messages: at least one message is required", param="messages")
    try:
        return check_chat(_CONVERTER.to_chat_completion_request(req))
    except ValueError as e:
        raise as_bad_request(e) from None


class MessagesShape:
    """One /v1/messages request (actors.frontend.api_shape.ApiShape)."""

    endpoint = ENDPOINT

    async def chat_request(self, body: bytes) -> ChatCompletionRequest:
        req: AnthropicMessagesRequest = validate_json(AnthropicMessagesRequest, body)
        if not req.messages:
            raise BadRequest("messages: at least one message is required", param="messages")
        try:
            chat = _CONVERTER.to_chat_completion_request(req)
        except ValueError as e:  # a tool change naming an undeclared tool; a field the chat refuses
            raise as_bad_request(e) from None
        return check_chat(chat)

    async def body(self, plan: Plan, chat: dict[str, Any]) -> dict[str, Any]:
        out = _CONVERTER.messages_full_converter(ChatCompletionResponse.model_validate(chat))
        return out.model_dump(exclude_none=True)

    async def events(self, plan: Plan, frames: AsyncIterator[str]) -> AsyncIterator[bytes]:
        async for event in _CONVERTER.message_stream_converter(frames):
            yield event.encode()

    def error_event(self, err: ActorError) -> bytes:
        return b"event: error\ndata: " + anthropic_error(err) + b"\n\n"


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")

