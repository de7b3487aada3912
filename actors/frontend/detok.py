"""Incremental detokenization and stop strings, enforced at the frontend across chunk boundaries.

Detokenization uses the ``tokenizers`` DecodeStream (what vLLM's FastIncrementalDetokenizer uses),
primed with the prompt so the first word gets its leading space right. Stop strings may straddle
chunks: a text suffix that is a prefix of some stop string is held back until it cannot be one.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class TextStream:
    """Token ids in, text deltas out; reports the stop string that ended the text, if any."""

    __slots__ = ("_tok", "_stream", "_stops", "_include", "_hold", "_text", "_sent", "_pieces", "stop_hit")

    def __init__(self, backend_tokenizer: Any, prompt_ids: list[int] | None, stop: list[str],
                 *, skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self._tok = backend_tokenizer
        tail = list(prompt_ids[-8:]) if prompt_ids else []  # enough context for spacing/bytes
        try:
            self._stream = DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens)
        except TypeError:  # older tokenizers without prefill
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = [s for s in stop if s]
        self._include = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""  # all text produced (up to a stop), kept while stop strings are watched
        self._sent = 0  # chars of _text already handed out
        # without stop strings nothing is held back: every piece goes out as it comes, and the text
        # is kept as its pieces (growing one string per token is quadratic in the output's length)
        self._pieces: list[str] = []
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        return self._text if self._stops else "".join(self._pieces)

    def add_tokens(self, token_ids: list[int], stop_terminated: bool = False) -> str:
        """Feed new tokens; return the text that is safe to send now ("" if held back).
        ``stop_terminated``: the last id is the token the engine stopped on (EOS or a stop_token_id),
        which vLLM's detokenizer leaves out of the text unless include_stop_str_in_output."""
        if self.stop_hit is not None:
            return ""
        if stop_terminated and not self._include:
            token_ids = token_ids[:-1]
        new = []
        step = self._stream.step
        for t in token_ids:
            try:
                piece = step(self._tok, t)
            except Exception:  # rare decoder overflow (seen by vLLM): drop the piece
                piece = None
            if piece:
                new.append(piece)
        return self.add_text("".join(new)) if new else ""

    def add_text(self, piece: str) -> str:
        """Feed text directly (text-mode workers that detokenize themselves)."""
        if self.stop_hit is not None or not piece:
            return ""
        if not self._stops:
            self._pieces.append(piece)
            return piece
        start = max(0, len(self._text) - self._hold)
        self._text += piece
        best = -1
        for s in self._stops:
            i = self._text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, self.stop_hit = i, s
        if best != -1:
            end = best + len(self.stop_hit) if self._include else best  # type: ignore[arg-type]
            self._text = self._text[:end]
            return self._take(len(self._text))
        return self._take(len(self._text) - self._partial_stop())

    def _partial_stop(self) -> int:
        """Length of the longest text suffix that could still grow into a stop string."""
        text, keep = self._text, 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        return keep

    def flush(self) -> str:
        """End of stream: release the held-back text."""
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self._text[self._sent:upto]
        self._sent = upto
        return out
