"""The response side of the OpenAI wire format: one builder shapes a request's worker chunks into
OpenAI objects, both as SSE chunks (``stream: true``) and as the one JSON body otherwise, so the
two modes cannot drift apart (text, echo, logprobs, finish/stop reasons, usage, worker headers)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from actors.engines.protocol import TokenLogprob
from actors.worker.contract import GenerateChunk
from bus.errors import ActorError

from .choices import Choice
from .openai_io import encode_json, error_body
from .planning import Plan

# The serving worker(s) of a response, and a client's pin to one worker on a request.
WORKER_HEADER = "x-worker-instance-id"
# which frontend process served a response, when the frontend runs as several (frontend.processes)
FRONTEND_HEADER = "x-frontend-instance-id"
# a client's session id: the kv router keeps the session on one worker while it is not overloaded
# (Dynamo's header name, so agent harnesses that send it for Dynamo work unchanged)
SESSION_HEADER = "x-dynamo-session-id"
# The prefill worker(s) of a disaggregated response.
PREFILL_HEADER = "x-prefill-instance-id"

SSE_DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# --- logprobs ---------------------------------------------------------------------------------------
def chat_logprobs(lps: list[TokenLogprob], token_str: Callable[[int], str]) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        s = token_str(lp.token_id)
        out.append({"token": s, "logprob": max(lp.logprob, -9999.0), "bytes": list(s.encode()),
                    "top_logprobs": [{"token": (t := token_str(tid)), "logprob": max(v, -9999.0),
                                      "bytes": list(t.encode())} for tid, v in lp.top]})
    return out


def completion_logprobs(lps: list[TokenLogprob], token_str: Callable[[int], str], offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = token_str(lp.token_id)
        tokens.append(s)
        token_lps.append(max(lp.logprob, -9999.0))
        tops.append({token_str(tid): max(v, -9999.0) for tid, v in lp.top} or None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# --- SSE --------------------------------------------------------------------------------------------
class ChunkFramer:
    """Pre-encodes the constant part of every SSE chunk of one response (id, object, created, model)."""

    __slots__ = ("_head",)

    def __init__(self, rid: str, obj: str, created: int, model: str) -> None:
        head = encode_json({"id": rid, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":['

    def choices(self, choices: list[dict[str, Any]]) -> bytes:
        return self._head + b",".join(encode_json(c) for c in choices) + b"]}\n\n"

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self._head + b'],"usage":' + encode_json(usage) + b"}\n\n"

    def error(self, err: ActorError) -> bytes:
        return b"data: " + error_body(err) + b"\n\n"


# --- the builder ------------------------------------------------------------------------------------
class ResponseBuilder:
    """One request's response. ``feed`` each (choice, chunk) as it arrives; a stream then writes
    ``sse_start``, the ``sse_piece`` of every fed chunk, ``sse_end``; a plain response asks for
    ``body`` once the chunks have ended. Both carry ``headers``."""

    def __init__(self, plan: Plan, choices: list[Choice]) -> None:
        self.plan = plan
        self.choices = choices
        self._want_logprobs = plan.out.logprobs is not None
        self._echoed: set[int] = set()
        self._framer: ChunkFramer | None = None
        self._offsets = [0] * len(choices)  # text sent so far per choice (completion logprob offsets)
        # the whole output per choice, kept only for the plain body
        self._texts: list[list[str]] = [[] for _ in choices]
        self._lps: list[list[TokenLogprob]] = [[] for _ in choices]
        self._ids: list[list[int]] = [[] for _ in choices]  # for the output parsers (plan.parsing)

    def headers(self) -> dict[str, str]:
        """The workers that served the choices (known once each choice's first chunk arrived)."""
        states = [c.flow.state for c in self.choices]
        workers = list(dict.fromkeys(s.worker_instance for s in states if s.worker_instance))
        prefills = list(dict.fromkeys(s.prefill_instance for s in states if s.prefill_instance))
        h = {}
        if workers:
            h[WORKER_HEADER] = ",".join(workers)
        if prefills:
            h[PREFILL_HEADER] = ",".join(prefills)
        return h

    def feed(self, c: Choice, chunk: GenerateChunk) -> str | None:
        """The choice's new text from one worker chunk (an echo request's prompt comes first), or
        None when the choice had already finished (a stop string) and the chunk is dropped."""
        if c.finish_reason is not None:
            return None
        delta = c.feed(chunk)
        if self.plan.out.echo and c.index not in self._echoed:
            self._echoed.add(c.index)
            delta = self.plan.echo_texts[c.index // self.plan.n] + delta
        if not self.plan.stream:
            self._texts[c.index].append(delta)
            if chunk.logprobs and self._want_logprobs:
                self._lps[c.index].extend(chunk.logprobs)
            if c.parsing is not None:
                self._ids[c.index].extend(chunk.token_ids)
        return delta

    def _logprobs(self, lps: list[TokenLogprob], offset: int) -> Any:
        pre = self.plan.pre
        if not self._want_logprobs or pre is None:
            return None
        if self.plan.chat:
            return {"content": chat_logprobs(lps, pre.token_str)}
        return completion_logprobs(lps, pre.token_str, offset)

    def _close(self, c: Choice) -> str:
        """End a choice whose flow ended without finishing it (should not happen): its held-back text."""
        if c.finish_reason is None:
            c.finish_reason = c.flow.state.finish_reason or "stop"
        return c.text.flush()

    def usage(self) -> dict[str, Any]:
        """The usage so far (the prompt's is known once each choice's first chunk arrived)."""
        prompt = cached = completion = 0
        for c in self.choices:
            st = c.flow.state
            completion += st.completion_tokens
            if c.index % self.plan.n == 0:  # prompt counted once per prompt, not per n
                prompt += st.prompt_tokens
                cached += st.cached_tokens
        return usage_dict(prompt, completion, cached)

    # --- stream: true --------------------------------------------------------------------------------
    def sse_start(self) -> list[bytes]:
        """The chunks before any output: a chat stream first announces the assistant's role."""
        plan = self.plan
        self._framer = ChunkFramer(plan.request_id, "chat.completion.chunk" if plan.chat else "text_completion",
                                   now(), plan.model)
        if not plan.chat:
            return []
        return [self._framer.choices([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None} for c in self.choices])]

    def sse_piece(self, c: Choice, chunk: GenerateChunk, delta: str) -> bytes | None:
        """The SSE chunk for ``delta`` (what ``feed`` returned); None when there is nothing to send."""
        assert self._framer is not None, "sse_start first"
        finished = c.finish_reason is not None
        want_lps = bool(chunk.logprobs and self._want_logprobs)
        piece: dict[str, Any] = {"index": c.index}
        if c.parsing is not None:
            # every piece goes through the parser, even one with no text yet: it tracks token ids
            parsed = c.parsing.delta(delta, chunk.token_ids, finished) if delta or chunk.token_ids or finished \
                else None
            if not parsed and not (finished or want_lps):
                return None
            piece["delta"] = parsed or {}
        elif not (delta or finished or want_lps):
            return None
        elif self.plan.chat:
            piece["delta"] = {"content": delta} if delta or not finished else {}
        else:
            piece["text"] = delta
        piece["logprobs"] = self._logprobs(chunk.logprobs, self._offsets[c.index]) if chunk.logprobs else None
        piece["finish_reason"] = c.finish_reason
        if finished:
            if c.parsing is not None:
                piece["finish_reason"] = c.parsing.stream_finish(c.finish_reason or "stop")
            piece["stop_reason"] = c.stop_reason
        self._offsets[c.index] += len(delta)
        return self._framer.choices([piece])

    def sse_end(self) -> list[bytes]:
        """The chunks after the last output: unfinished choices closed, then usage if asked for."""
        assert self._framer is not None, "sse_start first"
        out = []
        for c in self.choices:
            if c.finish_reason is None:
                text = self._close(c)
                finish = c.finish_reason
                if c.parsing is not None:
                    body: dict[str, Any] = {"delta": c.parsing.delta(text, [], True) or {}}
                    finish = c.parsing.stream_finish(finish or "stop")
                elif self.plan.chat:
                    body = {"delta": {"content": text}}
                else:
                    body = {"text": text}
                out.append(self._framer.choices([{"index": c.index, **body, "logprobs": None,
                                                  "finish_reason": finish}]))
        if self.plan.include_usage:
            out.append(self._framer.usage(self.usage()))
        return out

    def sse_error(self, err: ActorError) -> bytes:
        """A failure after the headers went out: the status is sent, so the error is an event."""
        assert self._framer is not None, "sse_start first"
        return self._framer.error(err)

    # --- stream: false -------------------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        plan = self.plan
        out = []
        for c in self.choices:
            text = "".join(self._texts[c.index]) + self._close(c)
            lp = self._logprobs(self._lps[c.index], 0)
            if plan.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if c.parsing is not None:
                    parsed = c.parsing.whole(text, self._ids[c.index])
                    message.update(parsed.fields())
                    finish = c.parsing.whole_finish(parsed, finish or "stop")
                out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
            else:
                if plan.out.echo and c.index not in self._echoed:
                    text = plan.echo_texts[c.index // plan.n] + text
                out.append({"index": c.index, "text": text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": plan.request_id, "object": "chat.completion" if plan.chat else "text_completion",
                "created": now(), "model": plan.model, "choices": out, "usage": self.usage()}
