"""Tokenization and chat templates at the frontend, so workers get token ids and the router sees tokens.

One ``Preprocessor`` per tokenizer directory, built once (loading is slow) and cached. The hot path
uses the Rust ``tokenizers`` backend directly and a compiled chat template; transformers is only
used to load the tokenizer with its special-token configuration.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from actors.models.tiny import resolve_model_path
from actors.worker.chat_render import render_chat
from config.topology import ModelConfig

from .built_once import BuiltOnce
from .discovery import ModelEntry, WorkerSet

log = logging.getLogger(__name__)


class Preprocessor:
    """Prompt → token ids for one model; also the tokenizer used for detokenization."""

    def __init__(self, tokenizer_path: str, chat_template_file: str | None = None) -> None:
        from transformers import AutoTokenizer  # heavy import: only when a model appears

        # one prompt at a time: rayon's thread pool only adds a hand-off (a 100-token prompt took
        # 78 µs with it off, 86-96 µs on); the operator's own setting wins
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.path = tokenizer_path
        self.hf = AutoTokenizer.from_pretrained(tokenizer_path)
        # The Rust tokenizer: encode/decode without the Python wrapper's per-call overhead.
        self.backend = getattr(self.hf, "backend_tokenizer", None) or self.hf._tokenizer
        self._encode_fast = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
        template = None
        if chat_template_file:
            template = Path(chat_template_file).read_text()
        self.chat_template: str | None = template or getattr(self.hf, "chat_template", None)
        eos = self.hf.eos_token_id
        self.eos_token_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        self._token_str: dict[int, str] = {}

    # --- prompts -------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        # the rendering a text-mode worker applies too: both modes give the same prompt
        return render_chat(self.hf, chat_template or self.chat_template, messages,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           template_kwargs=template_kwargs, tools=tools)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # the "fast" batch call skips the character offsets nobody here reads: the same ids in
        # 58 instead of 78 µs for a 100-token prompt (tokenizers 0.23)
        return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_id(self) -> int:
        """The tokenizer's largest id, added tokens included (vLLM's ``max_token_id``)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values())

    def token_str(self, token_id: int) -> str:
        """Text of one token as logprobs report it (cached: the vocabulary is fixed)."""
        s = self._token_str.get(token_id)
        if s is None:
            s = self.backend.decode([token_id], skip_special_tokens=False)
            self._token_str[token_id] = s
        return s


def tool_dicts(tools: Sequence[BaseModel] | None) -> list[dict[str, Any]] | None:
    """A request's tools as vLLM's chat path hands them to the chat template (``model_dump()``: a
    tool without a description or parameters renders them as null, as ``vllm serve`` does), so the
    prompt's tokens are the same as vLLM's (tests/frontend/test_probe_endpoints.py compares)."""
    return None if tools is None else [t.model_dump() for t in tools]


# one per process: tokenizers are immutable and slow to load; keyed by (tokenizer dir, template file)
SHARED: BuiltOnce[tuple[str, str | None], Preprocessor] = BuiltOnce("tokenizer", lambda k: Preprocessor(*k))


def tokenizer_key(mc: ModelConfig | None, path: str | None = None,
                  template: str | None = None) -> tuple[str, str | None] | None:
    """(tokenizer dir, template file) of a model, or None in text mode (no usable tokenizer here).
    The topology's model section ``mc`` wins over the card's ``path`` and ``template``, since it names
    paths on this host (a mocker's card says "mock"; a remote worker's paths are its own)."""
    if mc is not None:
        if mc.text_mode:
            return None  # model.text_mode: the workers tokenize and apply the chat template
        path = mc.tokenizer or mc.path or path
        template = mc.chat_template or template
    if not path or path == "mock":
        return None
    return resolve_model_path(path), template


class ModelPreprocessors:
    """A model's Preprocessor for its requests: loaded off the loop, once per tokenizer, as soon as
    the model's card appears (``warm``) rather than on its first request."""

    def __init__(self, workers: WorkerSet, model_config: ModelConfig | None) -> None:
        self.workers = workers
        self.model_config = model_config
        self.cache = SHARED
        self._loading: dict[tuple[str, str | None], asyncio.Future[Preprocessor | None]] = {}
        workers.listeners.append(self.warm)

    def model_path(self, entry: ModelEntry) -> str:
        """The model's directory on this host: the topology's ``model.path`` when the topology names
        this model, else the card's (a remote worker's path may not exist here)."""
        mc = self.model_config
        path = mc.path if mc is not None and mc.name == entry.name and mc.path else entry.card.model_path
        return resolve_model_path(path)

    def _key(self, entry: ModelEntry) -> tuple[str, str | None] | None:
        mc = self.model_config
        return tokenizer_key(mc if mc is not None and mc.name == entry.name else None, entry.card.tokenizer_path,
                             entry.card.chat_template)

    async def get(self, entry: ModelEntry) -> Preprocessor | None:
        """None: text mode (model.text_mode, or no usable tokenizer here): workers get text and chats."""
        key = self._key(entry)
        if key is None:
            return None
        pre = self.cache.peek(key)
        if pre is not None:
            return pre
        fut = self._loading.get(key)
        if fut is None:
            fut = self._loading[key] = asyncio.ensure_future(self._load(key))
        return await asyncio.shield(fut)

    async def _load(self, key: tuple[str, str | None]) -> Preprocessor | None:
        try:
            return await asyncio.to_thread(self.cache.get, key)
        except Exception as e:  # no usable tokenizer: text mode (the workers tokenize)
            log.warning("cannot load tokenizer %s (%s): text mode only", key[0], e)
            return None

    def warm(self) -> None:
        """WorkerSet listener: start loading the tokenizer of every model that has a card."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for entry in list(self.workers.models.values()):
            key = self._key(entry)
            if key is not None and key not in self._loading and self.cache.peek(key) is None:
                self._loading[key] = loop.create_task(self._load(key))
