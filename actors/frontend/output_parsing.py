"""Tool calls and reasoning in a chat completion's output, parsed with vLLM's own parsers.

vLLM's server holds one ``vllm.parser.Parser`` per choice: ``adjust_request`` constrains decoding
(the tools' JSON schema, or a parser's structural tag, for ``tool_choice`` "required" and named
tools) before sampling parameters are built; ``parse_delta`` turns each streamed delta into content,
reasoning and tool-call pieces; ``parse`` does the same for a whole output. This module does exactly
that with the classes vLLM's ``ParserManager`` composes from the topology's ``model.tool_call_parser``
and ``model.reasoning_parser``, so the accepted parsers and their output are vLLM's.

One difference, on purpose: vLLM 0.32 refuses ``tool_choice="required"`` and named tools unless a
tool-call parser is configured. Both only need the tools' JSON schema (the output is that JSON), so
without a configured parser they run with vLLM's base ``ToolParser``, whose required/named handling
is the JSON one. ``"auto"`` still needs a parser: only a model-specific parser can tell a tool call
from text.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
)
from vllm.parser import ParserManager
from vllm.parser.abstract_parser import DelegatingParser, Parser
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.tokenizers.hf import get_cached_tokenizer
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from bus.errors import ActorError, BadRequest

log = logging.getLogger(__name__)


class ParserUnusable(ActorError):
    """The topology's parser cannot work with this model's tokenizer (a deployment error, not the
    request's): 500 naming the setting."""

    code = 500
    kind = "internal_error"


def forced_tool_choice(req: ChatCompletionRequest) -> bool:
    """``tool_choice`` is "required" or names a function: the output must be tool calls."""
    return bool(req.tools) and (req.tool_choice == "required"
                                or isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam))


def _auto_tool_choice(req: ChatCompletionRequest) -> bool:
    # vLLM's request validator turns an absent tool_choice into "auto" when tools are given
    return bool(req.tools) and req.tool_choice in ("auto", None)


class ModelParsers:
    """The parser classes of one model: ``tool_call_parser`` and ``reasoning_parser`` composed by
    vLLM's ParserManager and checked against the model's tokenizer once (a parser that looks its
    marker tokens up in the vocabulary fails here, not in every request)."""

    def __init__(self, tool_call_parser: str | None, reasoning_parser: str | None, tokenizer: Any) -> None:
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        # vLLM's caching proxy, as its server gives the parsers: each parser reads the vocabulary
        # (get_vocab), which transformers rebuilds on every call: a cost per parser that grows with
        # the vocabulary (on the 2,048-token tiny model, 3.3 ms of set-up per request without it)
        self.tokenizer = get_cached_tokenizer(tokenizer)
        self.error: str | None = None
        self.parser_cls: type[Parser] | None = None
        self.forced_cls: type[Parser] | None = None
        try:
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_call_parser, reasoning_parser_name=reasoning_parser,
                enable_auto_tools=bool(tool_call_parser), tokenizer=tokenizer)
        except (TypeError, ValueError, KeyError) as e:
            # the topology named parsers vLLM knows (the loader checked) that this tokenizer lacks
            # the tokens for: requests that need them fail with this, the rest are served
            self.error = str(e)
            log.error("model parsers unusable with this tokenizer: %s", e)
            return
        if tool_call_parser:
            self.forced_cls = self.parser_cls
        else:
            # required/named without a tool-call parser: vLLM's base ToolParser constrains to the
            # tools' JSON schema and reads that JSON back (its supports_required_and_named path)
            base = self.parser_cls or DelegatingParser
            self.forced_cls = type("JsonToolsParser", (base,), {"tool_parser_cls": ToolParser})

    def for_request(self, req: ChatCompletionRequest) -> RequestParsing | None:
        """The request's parsing, after checking that its tool_choice can be served; None when its
        output is plain content (no tools asked for and no reasoning parser)."""
        if _auto_tool_choice(req) and not self.tool_call_parser:
            raise BadRequest('"auto" tool choice needs a tool-call parser for this model: set '
                             'model.tool_call_parser in the topology (vllm serve: --enable-auto-tool-choice '
                             '--tool-call-parser), or send tool_choice "required", a named tool or "none"',
                             param="tool_choice")
        forced = forced_tool_choice(req)
        cls = self.forced_cls if forced else self.parser_cls
        if self.error is not None and (forced or _auto_tool_choice(req) or self.reasoning_parser):
            raise ParserUnusable(f"model.tool_call_parser={self.tool_call_parser!r} / model.reasoning_parser="
                                 f"{self.reasoning_parser!r} cannot be used with this model's tokenizer: "
                                 f"{self.error}")
        if cls is None:
            return None
        return RequestParsing(cls, self.tokenizer, auto_tools=bool(self.tool_call_parser))


@dataclass
class ParsedMessage:
    """A whole output, split: what ``message`` of a chat completion holds."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    tools_called: bool  # auto parsing found calls (finish_reason "tool_calls")

    def fields(self) -> dict[str, Any]:
        """The chat message's fields (beside its role)."""
        out: dict[str, Any] = {"content": self.content}
        if self.reasoning is not None:
            out.update(reasoning_fields(self.reasoning))
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def reasoning_fields(text: str) -> dict[str, str]:
    """Reasoning under both names clients read: ``reasoning_content`` (DeepSeek's, the reference
    backend's) and ``reasoning`` (vLLM's since it renamed the field)."""
    return {"reasoning": text, "reasoning_content": text}


class RequestParsing:
    """One request's parsing: adjusts the request once, then gives each choice its own parser
    (vLLM's parsers keep per-stream state)."""

    def __init__(self, cls: type[Parser], tokenizer: Any, *, auto_tools: bool) -> None:
        self.cls = cls
        self.tokenizer = tokenizer
        self.auto_tools = auto_tools
        self.req: ChatCompletionRequest | None = None
        self.prompt_ids: list[int] | None = None
        # the parser that adjusted the request, handed to the first choice (vLLM's server also
        # parses with the instance that adjusted): one construction fewer per request
        self._spare: Parser | None = None

    def _new(self, req: ChatCompletionRequest) -> Parser:
        return self.cls(self.tokenizer, req.tools, chat_template_kwargs=req.chat_template_kwargs or {})

    def adjust(self, req: ChatCompletionRequest) -> ChatCompletionRequest:
        """vLLM's adjust_request: constrained decoding for forced tool calls, skip_special_tokens
        off where markers are special tokens. Done before the sampling options are built from it."""
        self._spare = self._new(req)
        try:
            adjusted = self._spare.adjust_request(req)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"tools: {e}", param="tools") from None
        assert isinstance(adjusted, ChatCompletionRequest)
        self.req = adjusted
        return adjusted

    def reasoning_ended(self, prompt_ids: list[int]) -> bool | None:
        """The engine's ``reasoning_ended`` (True: constrain from the first token; None: the engine's
        own reasoning parser looks at the prompt), as vLLM's server resolves it."""
        assert self.req is not None and self._spare is not None, "adjust first"
        self.prompt_ids = prompt_ids
        return self.req.resolve_reasoning_ended(self._spare, prompt_ids)  # is_reasoning_end is pure

    def choice(self) -> ChoiceParsing:
        assert self.req is not None, "adjust first"
        parser, self._spare = self._spare or self._new(self.req), None
        return ChoiceParsing(parser, self.req, self.auto_tools, self.prompt_ids)


class ChoiceParsing:
    """One choice's parser: ``delta`` per streamed piece, or ``whole`` once for a plain response."""

    def __init__(self, parser: Parser, req: ChatCompletionRequest, auto_tools: bool,
                 prompt_ids: list[int] | None) -> None:
        self.parser = parser
        self.req = req
        self.auto_tools = auto_tools
        self.prompt_ids = prompt_ids
        self.tools_streamed = False
        self.named = isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam)
        self.required = req.tool_choice == "required"

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        """The SSE ``delta`` for one piece of output; None when the parser holds it back (a marker
        token, part of a call's JSON not yet complete enough to send)."""
        try:
            dm = self.parser.parse_delta(text, list(token_ids), self.req, self.prompt_ids, finished=finished)
        except Exception as e:  # a parser bug must not kill the stream's framing: fail it typed
            log.exception("tool/reasoning parser failed on a delta")
            raise ParserFailed(f"output parser failed: {type(e).__name__}: {e}") from None
        if dm is None:
            return None
        out: dict[str, Any] = {}
        if dm.reasoning:
            out.update(reasoning_fields(dm.reasoning))
        if dm.content:
            out["content"] = dm.content
        calls = [tc for tc in dm.tool_calls if self.req.parallel_tool_calls is not False or tc.index == 0]
        if calls:
            self.tools_streamed = True
            out["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in calls]
        return out

    def stream_finish(self, reason: str) -> str:
        """vLLM's streamed finish_reason: "tool_calls" when calls were streamed (not for a named
        tool, which OpenAI reports as "stop")."""
        return "tool_calls" if self.tools_streamed and not self.named and reason == "stop" else reason

    def whole(self, text: str, token_ids: Sequence[int]) -> ParsedMessage:
        if self.prompt_ids is not None:
            self.parser.set_prompt_token_ids(self.prompt_ids)
            if (isinstance(self.parser, DelegatingParser) and self.parser.reasoning_parser is not None
                    and self.parser.is_reasoning_end(self.prompt_ids)):
                # the prompt closed the thinking (a continued assistant turn): the output is all
                # answer. vLLM's stream knows that (parse_delta checks the prompt), but its whole-
                # output parse of think-tag models calls text without </think> reasoning; we answer
                # as the stream does, so stream and non-stream agree
                self.parser._reasoning_parser = None
        try:
            reasoning, content, calls = self.parser.parse(text, self.req, enable_auto_tools=self.auto_tools,
                                                          model_output_token_ids=list(token_ids))
        except Exception as e:
            log.exception("tool/reasoning parser failed on an output")
            raise ParserFailed(f"output parser failed: {type(e).__name__}: {e}") from None
        if not self.req.include_reasoning:
            reasoning = None
        calls = list(calls or [])
        if self.req.parallel_tool_calls is False:
            calls = calls[:1]
        tool_calls = [{"id": c.id or make_tool_call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        if (self.named or self.required) and content is None:
            content = ""  # vLLM's forced-call message has content "" rather than null
        return ParsedMessage(content=content, reasoning=reasoning, tool_calls=tool_calls,
                             tools_called=bool(calls) and not (self.named or self.required))

    def whole_finish(self, parsed: ParsedMessage, reason: str) -> str:
        """vLLM's non-streamed finish_reason: "tool_calls" when auto parsing found calls, or for
        "required" that stopped normally."""
        if parsed.tools_called or (self.required and reason == "stop"):
            return "tool_calls"
        return reason


class ParserFailed(ActorError):
    code = 500
    kind = "internal_error"
