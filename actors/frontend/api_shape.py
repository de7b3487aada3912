"""What an API served as a chat completion must provide (/v1/responses, /v1/messages).

Such an API's request becomes one chat completion request, which the pipeline serves as it serves
/v1/chat/completions (routing, migration, cancellation, quarantine, limits, parsers); the shape
turns the result back into its API's body or stream events. One object per request: it keeps
what the other API's request said that the chat request cannot carry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from bus.errors import ActorError

if TYPE_CHECKING:
    from .planning import Plan


class ApiShape(Protocol):
    endpoint: str  # the metrics' endpoint label

    async def chat_request(self, body: bytes) -> ChatCompletionRequest:
        """The API's request body, validated, as a validated chat completion request."""
        ...

    async def body(self, plan: Plan, chat: dict[str, Any]) -> dict[str, Any]:
        """The API's response body for a whole chat completion (``stream: false``)."""
        ...

    def events(self, plan: Plan, frames: AsyncIterator[str]) -> AsyncIterator[bytes]:
        """The API's SSE events for the chat completion's SSE frames (``data: {...}`` each; the last
        is ``data: [DONE]`` only when the completion ended well)."""
        ...

    def error_event(self, err: ActorError) -> bytes:
        """A failure after the stream began, as the API's error event."""
        ...
