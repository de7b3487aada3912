"""The chat template, applied wherever the tokenizer is: at the frontend in token mode, at the
worker in text mode (``model.text_mode``: the frontend holds no tokenizer).

``render_chat`` is the one rendering for both sides, so a chat request becomes the same prompt
whichever side renders it, and greedy text-mode answers equal token-mode ones. The worker turns a
``GenerateRequest.chat`` into token ids itself (``ChatRenderer.prompt_ids``) instead of handing the
engine the rendered text: the template already wrote the special tokens (vLLM's chat default is
``add_special_tokens=False``, an engine's text prompt would get a second BOS), the worker knows the
prompt's exact length before the engine runs it (context check, usage, ``fit_max_tokens``), and a
migrated chat continues from the produced token ids, not from re-tokenized text.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec

from actors.engines.protocol import ModelFacts
from actors.models.tiny import resolve_model_path
from actors.worker.contract import ChatPrompt, GenerateRequest
from bus.errors import BadRequest
from config.topology import ModelConfig

log = logging.getLogger(__name__)


def flatten_content(msg: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts → a string (vLLM's "string" content format), unless the message holds
    images: then the parts stay a list (vLLM's "openai" format), text parts as they are and each
    image as ``{"type": "image"}``, which a vision model's template renders as its placeholder.
    Images reach this point only as ``{"type": "image"}`` (actors.frontend.media loaded and checked
    them); any other part type is refused."""
    content = msg.get("content")
    if not isinstance(content, list):
        return msg
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for part in content:
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype in ("text", "input_text", "refusal"):
            text = part.get("text") or part.get("refusal") or ""
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif ptype == "image":
            parts.append({"type": "image"})
        else:
            raise BadRequest(f"content part type {ptype!r} is not supported here (text and images only)")
    if len(parts) != len(texts):
        return {**msg, "content": parts}
    return {**msg, "content": "\n".join(texts)}


def render_chat(hf: Any, template: str | None, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of a chat, by ``hf`` (a transformers tokenizer) with ``template`` (the
    request's, the topology's file or the tokenizer's own). Every failure is a 400."""
    if not template:
        raise BadRequest("the model has no chat template; use /v1/completions or set "
                         "model.chat_template in the topology")
    msgs = [flatten_content(m) for m in messages]
    try:
        out = hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template,
            tools=tools, **(template_kwargs or {}))
    except BadRequest:
        raise
    except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
        raise BadRequest(f"chat template failed: {e}") from None
    return out if isinstance(out, str) else str(out)


class ChatRenderer:
    """A worker's chat template and tokenizer (the model's, as the frontend would load them)."""

    def __init__(self, tokenizer_path: str, chat_template_file: str | None = None) -> None:
        from transformers import AutoTokenizer  # heavy: only text-mode workers load it

        self.hf = AutoTokenizer.from_pretrained(tokenizer_path)
        # the Rust tokenizer, as the frontend's Preprocessor.encode uses it
        self._backend = getattr(self.hf, "backend_tokenizer", None) or self.hf._tokenizer
        template = Path(chat_template_file).read_text() if chat_template_file else None
        self.chat_template: str | None = template or getattr(self.hf, "chat_template", None)

    def prompt_ids(self, chat: ChatPrompt) -> list[int]:
        text = render_chat(self.hf, chat.chat_template or self.chat_template, chat.messages,
                           add_generation_prompt=chat.add_generation_prompt,
                           continue_final_message=chat.continue_final_message,
                           template_kwargs=chat.chat_template_kwargs, tools=chat.tools)
        ids: list[int] = self._backend.encode(text, add_special_tokens=chat.add_special_tokens).ids
        return ids + list(chat.continuation)


def renderer_source(model: ModelConfig | None, facts: ModelFacts) -> tuple[str, str | None] | None:
    """(tokenizer dir, template file) the way the frontend picks them: the topology's model
    section first (the mocker's own facts say "mock"), else what the engine loaded."""
    path = (model.tokenizer or model.path) if model is not None else None
    path = path or facts.tokenizer_path
    if not path or path == "mock":
        return None
    return resolve_model_path(path), model.chat_template if model is not None else None


class ChatSupport:
    """Whether and how this worker renders chat requests: loaded once per engine start, only for a
    model in text mode (a token-mode worker never imports transformers for it)."""

    def __init__(self, renderer: ChatRenderer | None, why_not: str) -> None:
        self.renderer = renderer
        self.why_not = why_not  # the 400's reason when there is no renderer

    @classmethod
    async def load(cls, model: ModelConfig | None, facts: ModelFacts) -> ChatSupport:
        name = model.name if model is not None else facts.served_model_name
        if model is None or not model.text_mode:
            return cls(None, f"model {name} is not in text mode (model.text_mode), so its workers "
                             "do not apply chat templates; they take token ids or a prompt")
        try:
            source = await asyncio.to_thread(renderer_source, model, facts)
            if source is None:
                return cls(None, f"model {name} names no tokenizer this worker can load "
                                 "(model.tokenizer), so it cannot apply the chat template")
            renderer = await asyncio.to_thread(ChatRenderer, *source)
        except Exception as e:  # noqa: BLE001 - completions still work: chat says why it cannot
            log.warning("text mode: cannot load the chat template of %s: %s", name, e)
            return cls(None, f"this worker could not load the tokenizer of model {name}: {e}")
        log.info("text mode: this worker renders chat for %s (tokenizer %s)", name, source[0])
        return cls(renderer, "")

    def token_request(self, req: GenerateRequest) -> GenerateRequest:
        """A chat request as the token-id request the engine runs (400 on any failure); any other
        request as it is."""
        chat = req.chat
        if chat is None:
            return req
        others = [n for n in ("token_ids", "prompt", "prompt_embeds") if getattr(req, n) is not None]
        if others:
            raise BadRequest(f"give exactly one of token_ids, prompt, prompt_embeds, chat "
                             f"(got chat, {', '.join(others)})")
        if self.renderer is None:
            raise BadRequest(f"cannot serve a chat request here: {self.why_not}")
        if not chat.messages:
            raise BadRequest("messages must not be empty", param="messages")
        if any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                          for p in m["content"]) for m in chat.messages):
            # the images would need the frontend's processor (MultiModalInput); text mode has none
            raise BadRequest("text mode takes no images", param="messages")
        return msgspec.structs.replace(req, chat=None, token_ids=self.renderer.prompt_ids(chat))
