"""OpenAI's Responses API (POST /v1/responses; GET and DELETE /v1/responses/{id}) as a chat
completion, with vLLM's own pieces.

The request is validated by vLLM's ``ResponsesRequest``; its input becomes chat messages by vLLM's
``construct_input_messages`` (instructions, input items, the stored conversation of a
``previous_response_id``) and its function tools by ``construct_tool_dicts``, as ``vllm serve``
renders them. The chat completion's output becomes output items by ``build_response_output_items``
(plain) or vLLM's ``SimpleStreamingEventProcessor`` (stream: ``response.created`` …
``response.output_text.delta`` … ``response.completed``), and the response object by
``ResponsesResponse.from_request``. The parsers (tool calls, reasoning) are the topology's, run by
the chat pipeline.

Stored responses live on the bus (``actors.frontend.response_store``), so a follow-up works from any
frontend process and after a restart. Not served: background mode, built-in tools (web search,
file search, code interpreter, MCP), reusable prompts; each is a 400 that says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pydantic
import pydantic_core
from vllm.entrypoints.generate.base.protocol import FunctionCall
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, DeltaMessage
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from vllm.entrypoints.openai.responses.streaming_events import (
    SimpleStreamingEventProcessor,
    _StateType,
    split_delta,
)
from vllm.entrypoints.openai.responses.utils import (
    build_response_output_items,
    construct_input_messages,
    construct_tool_dicts,
)

from bus.errors import ActorError, BadRequest, NotFound

from .openai_io import as_bad_request, check_chat, encode_json, validate_json
from .planning import Plan
from .response_store import ResponseStore, Stored, valid_id

log = logging.getLogger(__name__)

ENDPOINT = "responses"
PATH = "/v1/responses"

_json = msgspec.json.Decoder()
_DONE = "[DONE]"

# Request fields copied to the chat request as they are (same names, same meaning in vLLM's two
# models); the rest are translated below.
_SAME_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
                "skip_special_tokens", "include_stop_str_in_output", "parallel_tool_calls", "include_reasoning",
                "chat_template_kwargs", "cache_salt", "priority", "structured_outputs", "vllm_xargs")


def not_found(response_id: str, param: str = "response_id") -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param=param)  # vllm serve's words


def _tool_choice(choice: Any) -> Any:
    """A Responses tool_choice as the chat request's."""
    if isinstance(choice, str):  # auto, none, required
        return choice
    if getattr(choice, "type", None) == "function":
        return {"type": "function", "function": {"name": choice.name}}
    raise BadRequest(f"tool_choice of type {getattr(choice, 'type', None)!r} is not supported: only "
                     "auto, none, required and a named function", param="tool_choice")


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                   "strict": getattr(fmt, "strict", None)}}


def _nulls_as_defaults(req: ResponsesRequest) -> None:
    """A field sent as null takes its default: the response object copies several of them
    (background, truncation, store, ...) and has no null for them, and null means "unset" to
    OpenAI's API. Found by the HTTP fuzz, one field at a time, until this covered them all."""
    for name, info in ResponsesRequest.model_fields.items():
        if getattr(req, name, None) is None and not info.is_required():
            default = info.get_default(call_default_factory=True)
            if default is not None:
                setattr(req, name, default)


def _plain(obj: Any) -> Any:
    """Chat messages as JSON values (vLLM's message builders may leave pydantic objects in them)."""
    return _json.decode(pydantic_core.to_json(obj))


class ResponsesShape:
    """One /v1/responses request (actors.frontend.api_shape.ApiShape)."""

    endpoint = ENDPOINT

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store
        self._req: ResponsesRequest | None = None
        self._messages: list[dict[str, Any]] = []
        self._created = int(time.time())
        self._seq = 0

    @property
    def req(self) -> ResponsesRequest:
        assert self._req is not None, "chat_request first"
        return self._req

    async def chat_request(self, body: bytes) -> ChatCompletionRequest:
        req: ResponsesRequest = validate_json(ResponsesRequest, body)
        _nulls_as_defaults(req)
        self._refuse_unsupported(req)
        prev: Stored | None = None
        if req.previous_response_id is not None:
            if self.store is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            prev = await self.store.get(req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
        try:
            prev_output = ResponsesResponse.model_validate(prev.response).output if prev is not None else None
            messages = construct_input_messages(
                request_instructions=req.instructions, request_input=req.input,
                prev_msg=prev.messages if prev is not None else None, prev_response_output=prev_output)
            tools = construct_tool_dicts(req.tools, req.tool_choice)
        except (ValueError, TypeError, KeyError) as e:  # an input item vLLM cannot read
            raise as_bad_request(e) from None
        self._messages = _plain(messages)
        chat: dict[str, Any] = {name: v for name in _SAME_FIELDS
                                if (v := getattr(req, name, None)) is not None}
        chat["messages"] = self._messages
        if req.max_output_tokens is not None:
            chat["max_completion_tokens"] = req.max_output_tokens
        if tools:
            chat["tools"] = tools
            chat["tool_choice"] = _tool_choice(req.tool_choice)
        if (fmt := _response_format(req)) is not None:
            chat["response_format"] = fmt
        if req.reasoning is not None and req.reasoning.effort is not None:
            chat["reasoning_effort"] = req.reasoning.effort
        if req.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}  # the usage of response.completed
        self._req = req
        try:
            return check_chat(ChatCompletionRequest.model_validate(_plain(chat)))
        except (pydantic.ValidationError, ValueError) as e:
            raise as_bad_request(e) from None

    @staticmethod
    def _refuse_unsupported(req: ResponsesRequest) -> None:
        if req.background:
            raise BadRequest("background is not supported", param="background")
        if req.prompt is not None:
            raise BadRequest("prompt (a stored prompt template) is not supported", param="prompt")
        if getattr(req, "previous_input_messages", None):
            raise BadRequest("previous_input_messages is not supported: use previous_response_id",
                             param="previous_input_messages")
        for i, tool in enumerate(req.tools):
            if tool.type != "function":
                raise BadRequest(f"tools.{i}: tools of type {tool.type!r} are not supported: only function tools",
                                 param="tools")
        if req.is_include_output_logprobs():
            raise BadRequest("include message.output_text.logprobs is not supported", param="include")
        if not valid_id(req.request_id):
            raise BadRequest("request_id: expected 1-128 letters, digits, '_' or '-'", param="request_id")

    # --- the response object ----------------------------------------------------------------------------
    def _response(self, plan: Plan, output: list[Any], finish: str | None,
                  usage: dict[str, Any] | None) -> ResponsesResponse:
        status = "incomplete" if finish == "length" else "completed"
        u = None
        if usage is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            u = ResponseUsage(input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                              total_tokens=usage["total_tokens"],
                              input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=0),
                              output_tokens_details=OutputTokensDetails())
        return ResponsesResponse.from_request(self.req, plan.sampling[0], model_name=plan.model,  # type: ignore[arg-type]
                                              created_time=self._created, output=output, status=status, usage=u)

    def _initial(self, plan: Plan) -> ResponsesResponse:
        return ResponsesResponse.from_request(self.req, plan.sampling[0], model_name=plan.model,  # type: ignore[arg-type]
                                              created_time=self._created, output=[], status="in_progress")

    async def _dump(self, response: ResponsesResponse) -> dict[str, Any]:
        """The response as JSON, stored first when the request asks; its ``store`` says whether it
        was (OpenAI's field: a response that could not be stored must not claim it was)."""
        body = response.model_dump(mode="json", by_alias=True)
        body["store"] = False
        if self.req.store and self.store is not None:
            body["store"] = True
            body["store"] = await self.store.put(response.id, body, self._messages)
        return body

    # --- stream: false ----------------------------------------------------------------------------------
    async def body(self, plan: Plan, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        msg = choice["message"]
        calls = [FunctionCall(id=tc["id"], name=tc["function"]["name"], arguments=tc["function"]["arguments"])
                 for tc in msg.get("tool_calls") or []]
        reasoning = msg.get("reasoning") if self.req.include_reasoning else None
        output = build_response_output_items(reasoning, msg.get("content"), calls, tools=self.req.tools)
        return await self._dump(self._response(plan, output, choice.get("finish_reason"), chat.get("usage")))

    # --- stream: true -----------------------------------------------------------------------------------
    def _event(self, event: Any) -> bytes:
        if hasattr(event, "sequence_number"):
            event.sequence_number = self._seq
        self._seq += 1
        return (f"event: {event.type}\ndata: " + event.model_dump_json(indent=None, by_alias=True) + "\n\n").encode()

    async def events(self, plan: Plan, frames: AsyncIterator[str]) -> AsyncIterator[bytes]:
        initial = self._initial(plan).model_dump(mode="json", by_alias=True)
        yield self._event(ResponseCreatedEvent(type="response.created", sequence_number=-1, response=initial))
        yield self._event(ResponseInProgressEvent(type="response.in_progress", sequence_number=-1, response=initial))
        processor = SimpleStreamingEventProcessor(tools=self.req.tools)
        finish: str | None = None
        usage: dict[str, Any] | None = None
        done = False
        async for frame in frames:
            data = frame[5:].strip()  # "data: {...}"
            if data == _DONE:
                done = True
                break
            chunk = _json.decode(data)
            if chunk.get("usage") is not None and not chunk.get("choices"):
                usage = chunk["usage"]
                continue
            for c in chunk.get("choices") or ():
                finish = c.get("finish_reason") or finish
                delta = DeltaMessage.model_validate(c.get("delta") or {})
                if not self.req.include_reasoning:
                    delta.reasoning = None
                for dm in split_delta(delta):
                    target, call = processor.resolve_target_state(dm)
                    if target == _StateType.NONE:
                        continue
                    if processor.needs_transition(target, call):
                        for event in processor.close_current():
                            yield self._event(event)
                        for event in processor.open(target, call):
                            yield self._event(event)
                    for event in processor.emit_delta(dm, None):  # type: ignore[arg-type]
                        yield self._event(event)
        if not done:  # failed: the pipeline writes error_event
            return
        for event in processor.close_current():
            yield self._event(event)
        final = await self._dump(self._response(plan, processor.output_items, finish, usage))
        yield self._event(ResponseCompletedEvent(type="response.completed", sequence_number=-1, response=final))

    def error_event(self, err: ActorError) -> bytes:
        body = {"type": "error", "code": err.kind, "message": err.message, "param": err.param,
                "sequence_number": self._seq}
        self._seq += 1
        return b"event: error\ndata: " + encode_json(body) + b"\n\n"
