"""A span of output text that repeats an earlier one ends the request before it (a tool call made twice).

A small model under a tool grammar that allows several calls tends to write the same call again and again until
max_tokens. The server gives a tool format's call markers (`SamplingParams.repeat_stop`, e.g. ("<tool_call>",
"</tool_call>")); a span from `begin` to the next `end` whose text equals an earlier span's, whitespace outside
double-quoted strings ignored, stops the request where it begins: the text keeps the calls made so far and none of
the repeat. A stop string would be found the same way, so this is checked beside them, once per accepted token.

Streaming must agree with the whole answer, so once a span has completed, text that may still become a repeat is
held back: a later span while its text so far is a prefix of an earlier one's (it streams once it differs), and
the end of the text while it may be the start of `begin`.
"""

from __future__ import annotations


def normalise(text: str) -> str:
    """`text` without the whitespace outside double-quoted strings (JSON's; a backslash escapes the next char)."""
    out: list[str] = []
    quoted = escaped = False
    for ch in text:
        if quoted:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
            out.append(ch)
        elif not ch.isspace():
            out.append(ch)
    return "".join(out)


class RepeatedSpan:
    """Watches one request's growing output text for a span from `begin` to `end` that repeats an earlier one."""

    def __init__(self, begin: str, end: str) -> None:
        self.begin, self.end = begin, end
        self.seen: list[str] = []  # the completed spans, normalised, in order
        self.pos = 0  # where the next span is looked for: just after the last completed one

    def check(self, text: str) -> int | None:
        """Where a repeated span begins in `text` (the whole output so far), or None; call as the text grows."""
        while True:
            i = text.find(self.begin, self.pos)
            if i == -1:  # no span begins before the last len(begin) - 1 characters: not searched again
                self.pos = max(self.pos, len(text) - len(self.begin) + 1)
                return None
            j = text.find(self.end, i + len(self.begin))
            if j == -1:
                self.pos = i  # an open span: looked at again once more text came
                return None
            span = normalise(text[i:j + len(self.end)])
            if span in self.seen:
                return i
            self.seen.append(span)
            self.pos = j + len(self.end)

    def held_from(self, text: str) -> int:
        """Where the text that may still become a repeat begins (len(text): none); call after `check`."""
        if not self.seen:
            return len(text)
        i = text.find(self.begin, self.pos)
        if i != -1:
            so_far = normalise(text[i:])
            return i if any(s.startswith(so_far) for s in self.seen) else len(text)
        for k in range(min(len(self.begin) - 1, len(text)), 0, -1):
            if text.endswith(self.begin[:k]):
                return len(text) - k
        return len(text)
