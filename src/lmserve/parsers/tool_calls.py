"""Tool calls in generated text, for any format (tool_formats.py): streamed as events, or parsed whole.

The rules every format shares: the text around calls is content, in segments: the text before the first call,
between two calls, after the last one. Each segment is stripped, and one that is only whitespace (the newline
after a `</tool_call>`) is no segment. The segments join to one content string with SEGMENT_SEP between them
(the OpenAI chat `content`, Ollama's); the block APIs keep them apart, in order with the calls (`parts`):
Anthropic's text / tool_use blocks, the Responses API's message / function_call items. A list format's closer
right after a call (`closer`: mistral's and pythonic's "]", phi4_mini's "]<|/tool_call|>", gemma3's "```",
llama3_json's ";") is framing, not text. A call counts once its format's begin pattern matched (its name is then
complete) and its arguments ended. A format gives `find_begin` (where a call begins or may still begin) and a
reader per call (the arguments decided so far, compact JSON, and where the call ends).

`ToolCallStreamer` feeds deltas through them, holding back only what the next delta may still decide: text that
may become a begin or a closer, whitespace after content (a segment is stripped, so it counts only if more of
the segment follows), the undecided tail of a call. The first ContentDelta of a later segment carries the
separator in its `sep` (ContentDelta.joined), so the deltas join to the whole text's content on any split. `parse_tool_calls` is the same machine run over the whole text, so the two agree
on any text in which every call that begins also ends. A call cut off before its end (max_tokens) is where they
differ: the streamer cannot take back a call it has started (the client got its name and the arguments so far;
finish_reason "length" says why they are incomplete), while the whole-text parse drops it, and without any
complete call gives the whole text as content, since a call whose arguments are not complete JSON would break
a client's json.loads.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any, Protocol

from lmserve.parsers.events import ContentDelta, StreamEvent, ToolArgumentsDelta, ToolCallStart, drain

_ID_CHARS = string.ascii_letters + string.digits
_WS = " \t\r\n"
SEGMENT_SEP = "\n\n"  # between content segments (text before, between and after calls) joined to one string


class Begin(Protocol):
    """A begin pattern's match (a `regex` module match): the call's name, where the arguments start."""

    def end(self) -> int: ...

    def group(self, name: str) -> str: ...


class CallFormat(Protocol):
    """What the streamer needs of a tool-call format (tool_formats.ToolFormat)."""

    keeps_special_tokens: bool
    markup: Any  # a `regex` pattern of framing text that is never content, or None
    closer: tuple[str, ...]  # literals that may follow a call, each optional, in order (whitespace between)

    def find_begin(self, text: str, after_call: bool) -> tuple[int, Begin | None]:
        """(where a call begins, its match) or (where one may still begin, None); (len(text), None) if nowhere.

        `after_call`: the text starts right after a call (a list format's next call may continue there)."""

    def reader(self, schema: dict | None) -> "CallReader":
        """A reader for one call's text (`schema`: the called tool's parameters, when the request has it)."""


class CallReader(Protocol):
    """Reads one call's text after its begin, fed the same text as it grows."""

    def read(self, body: str, final: bool) -> tuple[str, int | None]:
        """(arguments decided so far, where in `body` the call ends or None); `final`: no more text follows.

        The arguments of a prefix of `body` are a prefix of those of `body`."""


def new_call_id() -> str:
    """A call id as OpenAI makes them: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    """One call the model made; `arguments` is its JSON text (compact: no whitespace between tokens)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The entry of an OpenAI message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStreamer:
    """Turns streamed text into content and call events, as `parse_tool_calls` splits the whole text."""

    def __init__(self, fmt: CallFormat, schemas: dict[str, dict] | None = None) -> None:
        self.fmt = fmt
        self.schemas = schemas or {}  # tool name -> its parameters schema (qwen3_xml converts values by type)
        self._reader: CallReader | None = None
        self._pending = ""  # text not yet turned into events (inside a call: all of its body so far)
        self._in_call = False
        self._after_call = False  # the pending text starts right where a call ended
        self._segment_started = False  # until then, whitespace is leading and dropped
        self._content_sent = False  # a segment was sent: the next one begins with SEGMENT_SEP
        self._sent = 0  # characters of the current call's arguments sent
        self.num_calls = 0

    @property
    def in_call(self) -> bool:
        """Whether a call has begun and not ended."""
        return self._in_call

    def feed(self, delta_text: str) -> list[StreamEvent]:
        """Events for the next piece of generated text."""
        self._pending += delta_text
        return drain(self._step, False)

    def finish(self) -> list[StreamEvent]:
        """Events for what was held back, once the text is complete."""
        events = drain(self._step, True)
        self._pending = ""
        return events

    def _step(self, events: list[StreamEvent], final: bool) -> bool:
        """Turn the decided part of the pending text into events; True if a call began or ended."""
        return self._arguments(events, final) if self._in_call else self._outside(events, final)

    def _outside(self, events: list[StreamEvent], final: bool) -> bool:
        """Content (or text between calls) up to a call's begin; True if a call began."""
        if self._after_call and self.fmt.closer:
            end = match_closer(self._pending, self.fmt.closer, final)
            if end is None:
                return False
            if self._pending[:end].strip(_WS):  # the list closed: no call continues it
                self._after_call = False
            self._pending = self._pending[end:]
        start, begin = self.fmt.find_begin(self._pending, self._after_call)
        if begin is None and final:
            start = len(self._pending)  # a begin that never completed is text
        if begin is not None or start > 0:
            self._after_call = False
        text, framed = self._pending[:start], start
        if self.fmt.markup is not None:
            text, framed = unframe(text, self.fmt.markup, final=begin is not None or final)
        held = self._content(events, text, more_follows=begin is None and not final)
        if begin is None:
            self._pending = held + self._pending[framed:]
            return False
        name = begin.group("name")
        events.append(ToolCallStart(self.num_calls, new_call_id(), name))
        self._reader = self.fmt.reader(self.schemas.get(name))
        self.num_calls += 1
        self._in_call, self._sent = True, 0
        self._pending = self._pending[begin.end():]
        return True

    def _arguments(self, events: list[StreamEvent], final: bool) -> bool:
        """Arguments decided so far; True if the call ended."""
        arguments, end = self._reader.read(self._pending, final)
        if len(arguments) > self._sent:
            events.append(ToolArgumentsDelta(self.num_calls - 1, arguments[self._sent:]))
            self._sent = len(arguments)
        if end is None:
            return False
        self._pending = self._pending[end:]
        self._in_call, self._after_call, self._segment_started = False, True, False
        return True

    def _content(self, events: list[StreamEvent], text: str, more_follows: bool) -> str:
        """Emit decided content; returns the trailing whitespace to hold while more of the segment may follow."""
        if not self._segment_started:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            sep = SEGMENT_SEP if self._content_sent and not self._segment_started else ""
            events.append(ContentDelta(body, sep))
            self._segment_started = self._content_sent = True
        return text[len(body):] if more_follows else ""


def match_closer(text: str, closer: tuple[str, ...], final: bool) -> int | None:
    """Where the closer at the start of `text` ends (0: none there), or None while more text may still decide it
    (its next literal may be starting). Each literal is optional and may follow whitespace."""
    pos = 0
    for literal in closer:
        at = pos
        while at < len(text) and text[at] in _WS:
            at += 1
        if text.startswith(literal, at):
            pos = at + len(literal)
        elif not final and literal.startswith(text[at:]):
            return None
    return pos


def unframe(text: str, markup: Any, final: bool) -> tuple[str, int]:
    """`text` without `markup`'s matches, up to where one that may still complete begins (len(text) if none or
    `final`), and that place."""
    out, pos = [], 0
    for m in markup.finditer(text, partial=not final):
        out.append(text[pos:m.start()])
        if m.partial:
            return "".join(out), m.start()
        pos = m.end()
    return "".join(out) + text[pos:], len(text)


def parse_tool_parts(text: str, fmt: CallFormat, schemas: dict[str, dict] | None = None) -> list[str | ToolCall]:
    """A whole generated text's content segments and calls, in order."""
    streamer = ToolCallStreamer(fmt, schemas)
    events = streamer.feed(text) + streamer.finish()
    parts: list[str | ToolCall] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ContentDelta):
            if parts and isinstance(parts[-1], str):
                parts[-1] += e.text
            else:
                parts.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append(ToolCall(e.id, e.name, ""))
            parts.append(calls[-1])
        elif isinstance(e, ToolArgumentsDelta):
            calls[e.index].arguments += e.text
    if streamer.in_call:  # cut off: not a call (nothing follows an open call)
        calls.pop()
        parts.pop()
    if not calls:
        whole = (unframe(text, fmt.markup, True)[0] if fmt.markup is not None else text).strip()
        return [whole] if whole else []
    return parts


def parse_tool_calls(text: str, fmt: CallFormat,
                     schemas: dict[str, dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole generated text: the content segments joined (None when there are none)."""
    parts = parse_tool_parts(text, fmt, schemas)
    return join_content(parts), [p for p in parts if isinstance(p, ToolCall)]


def join_content(parts: list[str | ToolCall]) -> str | None:
    """The content segments of `parts` as one string (None when there are none)."""
    return SEGMENT_SEP.join(p for p in parts if isinstance(p, str)) or None
