"""Scripted replies: the mocker answers given text for prompts that contain a given substring, so
that what parses a real model's text (tool calls, reasoning) is tested end to end with no model.

The ``script`` arg (see ``config.py``) is a list of ``{when, text}`` tables. The first entry whose
``when`` occurs in the prompt's text gives the reply: ``text`` encoded with the tokenizer (no
special tokens added), emitted one token per step, then EOS. A prompt no entry matches gets the
usual pseudo-tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from actors.engines.mocker.text_codec import TextCodec

ENTRY_KEYS = ("when", "text")


@dataclasses.dataclass(frozen=True)
class ScriptEntry:
    when: str  # a substring of the prompt's text; "" matches every prompt
    text: str  # the reply ("" is a reply too: EOS at once)


def parse_script(raw: Any) -> tuple[ScriptEntry, ...]:
    """The ``script`` arg as entries; a bad shape is a ValueError naming the key (``script[2].text``)."""
    if not isinstance(raw, list):
        raise ValueError(f"mocker arg script must be a list of {{when, text}} tables, got {type(raw).__name__}")
    entries: list[ScriptEntry] = []
    for i, item in enumerate(raw):
        key = f"script[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"mocker arg {key} must be a table with keys {ENTRY_KEYS}, got {item!r}")
        for k in item:
            if k not in ENTRY_KEYS:
                raise ValueError(f"mocker arg {key}: unknown key {k!r} (known: {', '.join(ENTRY_KEYS)})")
        if "text" not in item:
            raise ValueError(f"mocker arg {key}.text is required")
        when = item.get("when", "")
        for k, v in (("when", when), ("text", item["text"])):
            if not isinstance(v, str):
                raise ValueError(f"mocker arg {key}.{k} must be a string, got {v!r}")
        entries.append(ScriptEntry(when=when, text=item["text"]))
    return tuple(entries)


class Script:
    """The entries with their replies tokenized once; ``reply`` picks one for a prompt."""

    def __init__(self, entries: Sequence[ScriptEntry], codec: TextCodec, vocab_size: int) -> None:
        self.codec = codec
        self._entries = [(e.when, codec.encode(e.text, add_special_tokens=False)) for e in entries]
        for i, (_, ids) in enumerate(self._entries):
            if ids and max(ids) >= vocab_size:  # the mocker's token range is its "model's" vocabulary
                raise ValueError(f"mocker arg script[{i}].text encodes to token id {max(ids)}, "
                                 f"outside vocab_size {vocab_size}")

    def reply(self, prompt_text: str, prompt_ids: Sequence[int]) -> list[int] | None:
        """The reply's token ids still to come for a prompt, or None when no entry matches.

        A migrated request comes back with the reply's first tokens appended to its prompt: the
        reply then goes on after them instead of starting again (the longest head of the reply that
        ends the prompt counts as already emitted).
        """
        for when, ids in self._entries:
            if when in prompt_text:
                return ids[_emitted(prompt_ids, ids):]
        return None


def _emitted(prompt_ids: Sequence[int], reply: Sequence[int]) -> int:
    for k in range(min(len(reply), len(prompt_ids)), 0, -1):
        if list(prompt_ids[-k:]) == list(reply[:k]):
            return k
    return 0
