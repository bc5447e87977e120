"""Where a JSON text prefix is, and the shortest text that closes it: the syntax half of the limit steer.

Tolerant by design: text outside any {...} / [...] is skipped, so one scanner can follow a whole output in which
JSON sits inside markup (a tool call's `<tool_call>` tags). limit.py uses `owed()` to rank the characters its
search tries and `closing()` to end a JSON answer by syntax alone when the schema's own completion cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JsonScan:
    """A tolerant JSON prefix scanner: text outside any {...} / [...] is skipped (a tool call's markup), so it can
    follow a whole output; `closing()` is the shortest text that closes what is open."""

    stack: list[str] = field(default_factory=list)  # "{" / "["
    # value (may close an array) | value_req | key (may close an object) | key_req | colon | after | str | esc |
    # hex | num | lit
    mode: str = "value"
    is_key: bool = False  # the open string is an object key
    hex_seen: int = 0
    lit_rest: str = ""  # what a partial true / false / null still needs
    num_last: str = ""
    started: bool = False  # a value has begun at the root

    def copy(self) -> "JsonScan":
        return JsonScan(list(self.stack), self.mode, self.is_key, self.hex_seen, self.lit_rest, self.num_last,
                        self.started)

    def feed(self, text: str) -> "JsonScan":
        for c in text:
            self._char(c)
        return self

    def _char(self, c: str) -> None:  # noqa: C901, PLR0912 - one state machine, one branch per state
        m = self.mode
        if m == "str":
            if c == "\\":
                self.mode = "esc"
            elif c == '"':
                self.mode = "colon" if self.is_key else "after"
        elif m == "esc":
            self.mode, self.hex_seen = ("hex", 0) if c == "u" else ("str", 0)
        elif m == "hex":
            self.hex_seen += 1
            if self.hex_seen == 4:
                self.mode = "str"
        elif m == "lit":
            self.lit_rest = self.lit_rest[1:]
            if not self.lit_rest:
                self.mode = "after"
        elif m == "num" and (c.isdigit() or c in "+-.eE"):
            self.num_last = c
        elif c in " \t\r\n":
            if m == "num":
                self.mode = "after"
        elif m == "num":
            self.mode = "after"
            self._char(c)
        elif m in ("key", "key_req") and c == '"':
            self.mode, self.is_key = "str", True
        elif m == "key" and c == "}" or m == "after" and c in "}]":
            self._close()
        elif m == "colon" and c == ":":
            self.mode = "value"
        elif m == "after" and c == ",":
            self.mode = "key_req" if self.stack and self.stack[-1] == "{" else "value_req"
        elif m in ("value", "value_req"):
            self._value(c)
        elif not self.stack:  # after a root value: skip text until the next one
            self.mode = "value"

    def _value(self, c: str) -> None:
        if not self.stack and c not in '{["-0123456789tfn':
            return  # markup around the JSON (a tool call's tags)
        if not self.stack:
            self.started = True
        if c in "{[":
            self.stack.append(c)
            self.mode = "key" if c == "{" else "value"
        elif c == "]" and self.mode == "value" and self.stack and self.stack[-1] == "[":
            self._close()
        elif c == '"':
            self.mode, self.is_key = "str", False
        elif c in "-0123456789":
            self.mode, self.num_last = "num", c
        elif c in "tfn":
            self.mode, self.lit_rest = "lit", {"t": "rue", "f": "alse", "n": "ull"}[c]

    def _close(self) -> None:
        if self.stack:  # a closer with nothing open is markup around the JSON (a pythonic call's "}")
            self.stack.pop()
        self.mode = "after" if self.stack else "value"

    @property
    def half_key(self) -> bool:
        """Inside an object between its keys: closing here would have to make up a key ("" or a partial name)."""
        return self.mode in ("colon", "key_req") or self.mode in ("str", "esc", "hex") and self.is_key

    def owed(self) -> int:
        """How much is open: containers, plus one for an unfinished string, literal, number or value (after a ","
        the grammar, not the syntax, knows whether more must follow)."""
        unfinished = self.mode in ("str", "esc", "hex", "lit", "colon") or (
            self.mode == "num" and self.num_last in "+-.eE") or (
            self.mode == "value" and (not self.stack or self.stack[-1] == "{"))
        return len(self.stack) + unfinished

    def closing(self) -> str:
        """The shortest text after which every open string, literal, number, array and object is closed."""
        m, out = self.mode, ""
        if m in ("str", "esc", "hex"):
            out = {"esc": "\\", "hex": "0" * (4 - self.hex_seen)}.get(m, "") + '"'
            out += ":null" if self.is_key else ""
        elif m == "lit":
            out = self.lit_rest
        elif m == "num" and self.num_last in "+-.eE":
            out = "0"
        elif m == "colon":
            out = ":null"
        elif m == "key_req":
            out = '"":null'
        elif m == "value_req" or m == "value" and self.stack and self.stack[-1] == "{":
            out = "null"  # after a key's colon, or after an array's comma
        return out + "".join("}" if b == "{" else "]" for b in reversed(self.stack))
