"""Tool calls in a streamed chat: generated text in, content and call events out, then OpenAI deltas.

`ToolCallStreamer` agrees with `tools.parse_tool_calls` on any text in which every call that begins
also ends, however the text is split into deltas. It holds back only what the next delta may still
decide: text that may become a call's begin string, a possible start of the end string inside
arguments, and whitespace after content (content is stripped, so it counts only if more content
follows). It cannot take back a call it has started, so for a call cut off before its end
(max_tokens) it sends everything generated after the begin string as that call's arguments, where
the whole-text parse would call it content; finish_reason "length" tells the client why the
arguments are incomplete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Union

from lmserve.server.api.tools import CALL_BEGIN, CALL_BEGIN_RE, CALL_END, NAME_END, CompactJSON, new_call_id

_MAX_NAME = 64  # as protocol.TOOL_NAME_PATTERN
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]{0,%d}" % (_MAX_NAME + 1))  # one more: enough to see a name is too long


@dataclass
class ContentDelta:
    """Text for `delta.content`."""

    text: str


@dataclass
class ToolCallStart:
    """A call begins; its name is complete."""

    index: int
    id: str
    name: str


@dataclass
class ToolArgumentsDelta:
    """A fragment of call `index`'s arguments."""

    index: int
    text: str


StreamEvent = Union[ContentDelta, ToolCallStart, ToolArgumentsDelta]


class ToolCallStreamer:
    """Turns streamed text into content and call events, as `parse_tool_calls` splits the whole text."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet turned into events
        self._in_call = False
        self._content_started = False  # until then, whitespace is leading and dropped
        self._compact = CompactJSON()
        self.num_calls = 0

    def feed(self, delta_text: str) -> list[StreamEvent]:
        """Events for the next piece of generated text."""
        self._pending += delta_text
        events: list[StreamEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[StreamEvent]:
        """Events for what was held back, once the text is complete."""
        events: list[StreamEvent] = []
        if self._in_call:  # cut off inside a call: the client gets all that was generated
            self._emit_arguments(events, self._pending)
        else:
            self._content(events, self._pending, more_follows=False)
        self._pending = ""
        return events

    def _step(self, events: list[StreamEvent]) -> bool:
        """Turn the decided part of the pending text into events; True if a call began or ended."""
        return self._arguments(events) if self._in_call else self._outside(events)

    def _outside(self, events: list[StreamEvent]) -> bool:
        """Content (or text between calls) up to a call's begin string; True if a call began."""
        start, begin = _find_begin(self._pending)
        held = self._content(events, self._pending[:start], more_follows=begin is None)
        if begin is None:
            self._pending = held + self._pending[start:]
            return False
        events.append(ToolCallStart(self.num_calls, new_call_id(), begin.group(1)))
        self.num_calls += 1
        self._compact = CompactJSON()  # this call's arguments, compacted as parse_tool_calls compacts them
        self._in_call = True
        self._pending = self._pending[begin.end():]
        return True

    def _arguments(self, events: list[StreamEvent]) -> bool:
        """Arguments up to the end string; True if the call ended."""
        end = self._pending.find(CALL_END)
        if end >= 0:
            self._emit_arguments(events, self._pending[:end])
            self._pending = self._pending[end + len(CALL_END):]
            self._in_call = False
            return True
        keep = len(self._pending) - _partial_suffix(self._pending, CALL_END)
        self._emit_arguments(events, self._pending[:keep])
        self._pending = self._pending[keep:]
        return False

    def _content(self, events: list[StreamEvent], text: str, more_follows: bool) -> str:
        """Emit decided content; returns the trailing whitespace to hold while more content may follow."""
        if self.num_calls:  # text between and after calls is not content
            return ""
        if not self._content_started:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            events.append(ContentDelta(body))
            self._content_started = True
        return text[len(body):] if more_follows else ""

    def _emit_arguments(self, events: list[StreamEvent], text: str) -> None:
        text = self._compact.feed(text)
        if text:
            events.append(ToolArgumentsDelta(self.num_calls - 1, text))


def _find_begin(text: str) -> tuple[int, re.Match[str] | None]:
    """Where a call's begin string is (with its match) or may still be (None); len(text) if nowhere.

    Only the first candidate matters: a begin string has "<" only at its start, so text that may still
    become one holds no later "<", and the first complete one is also the first candidate.
    """
    k = text.find("<")
    while k >= 0:
        begin = CALL_BEGIN_RE.match(text, k)
        if begin is not None or _may_begin(text, k):
            return k, begin
        k = text.find("<", k + 1)
    return len(text), None


def _may_begin(text: str, k: int) -> bool:
    """Whether text[k:] is the start of some call's begin string (more text could complete it)."""
    rest = text[k:]
    if len(rest) <= len(CALL_BEGIN):
        return CALL_BEGIN.startswith(rest)
    if not rest.startswith(CALL_BEGIN):
        return False
    name = _NAME_CHARS.match(rest, len(CALL_BEGIN)).end() - len(CALL_BEGIN)  # type: ignore[union-attr]
    tail = rest[len(CALL_BEGIN) + name:]
    return name <= _MAX_NAME and (not tail or (name > 0 and NAME_END.startswith(tail)))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# -- OpenAI chunks ---------------------------------------------------------------------------------

def chat_chunk_tool_calls(events: list[StreamEvent]) -> list[dict[str, Any]]:
    """`delta.tool_calls` entries: a start entry per call, then its argument fragments (adjacent ones joined).

    Entries may go in one chunk (clients merge them by index) or one chunk each, as vLLM sends them.
    """
    entries: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            entries.append({"index": event.index, "id": event.id, "type": "function",
                            "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, ToolArgumentsDelta):
            last = entries[-1] if entries else None
            if last is not None and last["index"] == event.index and "id" not in last:
                last["function"]["arguments"] += event.text
            else:
                entries.append({"index": event.index, "function": {"arguments": event.text}})
    return entries


def chat_chunk_delta(events: list[StreamEvent]) -> dict[str, Any]:
    """A chunk's `delta` for these events: "content" and/or "tool_calls", each only when present."""
    delta: dict[str, Any] = {}
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    if content:
        delta["content"] = content
    tool_calls = chat_chunk_tool_calls(events)
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta
