"""Generated tokens to text pieces, one character never split across two pieces."""
from __future__ import annotations

from typing import Any


class Detokenizer:
    """Turns generated tokens into text pieces without splitting a character.

    vLLM's incremental detokenization: decode a short window that starts a few tokens back
    (so a tokenizer that drops or adds a leading space at the start of a decode does it on both
    sides of the difference) and emit the text it gained; hold tokens back while the text ends in
    U+FFFD (an incomplete multi-byte character) or gained nothing (e.g. a skipped special token).
    Decoding a window, not the whole output, keeps each step O(1) in the output length.
    """

    _LOOKBACK = 5

    def __init__(self, tokenizer: Any, context: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context[-self._LOOKBACK :])
        self._first = len(self._ids)
        self._prefix = 0
        self._read = self._first

    @property
    def committed(self) -> list[int]:
        """Generated tokens whose text has been emitted."""
        return self._ids[self._first : self._read]

    def push(self, token: int) -> str:
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held, incomplete character included: the run is over."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)
