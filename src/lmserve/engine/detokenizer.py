"""Incremental detokenization for streaming.

Each step decodes only a short window of recent ids twice (up to the last emitted point, and to
the end) and emits the difference, holding it back while it ends in an incomplete UTF-8 sequence
(U+FFFD). Decoding both from the same start keeps tokenizer-specific leading-space handling out
of the delta, and the pieces join to exactly the one-shot decode.
"""

from __future__ import annotations

from typing import Sequence

from lmserve.tokenizer import Tokenizer

PROMPT_CONTEXT = 5  # prompt tokens kept as leading context for the first output token


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a multi-byte character still incomplete
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete sequence decodes to U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
