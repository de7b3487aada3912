"""The mocker's real tokenizer, when its ``tokenizer`` arg names one: text prompts are encoded with
it, output text and scripted replies decoded and encoded with it, so text reaches the frontend as a
real model's would (tool-call tags as the tokens the parsers look for).

Loaded with the light ``tokenizers`` library from ``tokenizer.json``: a mocker worker never imports
transformers (seconds of start-up). Without a ``tokenizer`` arg the mocker keeps its byte prompts
and ``" t<id>"`` output text (``tokens.py``).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

# A UTF-8 character has at most 4 bytes, and every byte-level token holds at least one: text still
# ending in U+FFFD after this many held tokens is not a character waiting for its last bytes but
# bytes that never form one (the mocker's pseudo-tokens draw such bytes), and is let through.
MAX_HELD_TOKENS = 4


class TextCodec:
    """Encode/decode with one tokenizer (``path``: a model directory or its tokenizer.json)."""

    def __init__(self, path: str) -> None:
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # a missing file, or not a tokenizers JSON (the library raises its own)
            raise ValueError(f"mocker arg tokenizer: cannot load {file}: {e}") from None
        self.path = str(file)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """One request's output text, delta by delta (vLLM's prefix/read offsets): the text of new tokens
    is the decode of a short window minus that of its already emitted head, held back while it ends
    in a partial UTF-8 character."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: decoding from here gives the emitted text's tail
        self._read_offset = 0  # tokens before this are emitted

    def push(self, token_ids: list[int]) -> str:
        """The text that ``token_ids`` (appended to the output so far) add; may be empty."""
        self._ids.extend(token_ids)
        head = self._codec.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        text = self._codec.decode(self._ids[self._prefix_offset:], self._skip)
        held = len(self._ids) - self._read_offset
        if len(text) <= len(head) or (text.endswith("\ufffd") and held < MAX_HELD_TOKENS):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(head):]
