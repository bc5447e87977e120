"""OpenAI tool calling, server side: prompts that offer tools, and model text parsed back into calls.

A call is written in exactly this form (Hermes / Qwen style, what xgrammar's "qwen_3" structural tag
constrains it to), and several may follow each other:

    <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>

that is `call_begin(NAME)`, then the arguments JSON object, then `CALL_END`. Text may come before
the first call (tool_choice "auto").

Prompting (`prepare_chat`): a template that reads a `tools` variable gets the OpenAI tool dicts as
that variable, and assistant `tool_calls` keep their structure (arguments parsed into a dict, as
transformers templates expect). A template without one (SmolLM2's ChatML) gets the history as text
instead: TOOL_PREAMBLE goes at the end of the system message (a new one is put first if the chat has
none). The preamble tells the model it may call functions, lists each tool as one JSON line between
<tools> and </tools>, shows the exact <tool_call> form above (one block per call), says that results
come back between <tool_response> tags, and that it should answer directly when no call is needed.
Past calls become that same text after the assistant's content; tool results become a user turn of
`<tool_response>` blocks (consecutive results share one turn), each a JSON object with the function's
name (found through tool_call_id) and the result (embedded as JSON when it parses as JSON).

Parsing (`parse_tool_calls`, `ToolCallStreamer`): a call counts once its begin string (with a valid
function name) and its end string are both there; the arguments are the raw text between, not
validated or re-serialised (the grammar guarantees them). Content is the text before the first call,
stripped; text between or after calls is dropped. A call cut off before its end (max_tokens) is not a
call: without any complete call the whole text is content, since a call whose arguments are not
complete JSON would break a client's json.loads. The streamer agrees with `parse_tool_calls` on any
text in which every call that begins also ends, for any split into deltas. It cannot take back a call
it has started, so for a cut-off call it sends everything generated after the begin string as that
call's arguments; finish_reason "length" tells the client why they are incomplete.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Union

import jinja2
import jinja2.meta

from lmserve.engine.chat_template import message_text
from lmserve.server.protocol import TOOL_NAME_PATTERN

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_BEGIN = TOOL_CALL_OPEN + '\n{"name": "'  # then the name
NAME_END = '", "arguments": '  # then the arguments object
CALL_END = "}\n" + TOOL_CALL_CLOSE  # its "}" closes the {"name": ...} object

TOOL_PREAMBLE = """You may call one or more functions to help with the user's request. \
The functions are listed below, one JSON object per line, between <tools> and </tools>:
<tools>
{tools}
</tools>

To call a function, write a block in exactly this form, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
The result of each call comes back to you between <tool_response> and </tool_response>. \
If no function is needed, answer directly."""

_BEGIN_RE = re.compile(re.escape(CALL_BEGIN) + f"({TOOL_NAME_PATTERN})" + re.escape(NAME_END))
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]{0,65}")
_MAX_NAME = 64
_ID_CHARS = string.ascii_letters + string.digits
_GENERATION_TAG = re.compile(r"{%-?\s*(end)?generation\s*-?%}")  # a tag only our renderer knows


def call_begin(name: str) -> str:
    """The text that opens a call to `name`, up to its arguments object."""
    return CALL_BEGIN + name + NAME_END


def format_tool_call(name: str, arguments: str) -> str:
    """One call as the model writes it."""
    return call_begin(name) + arguments + CALL_END


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template's Jinja source reads a `tools` variable."""
    if not template:
        return False
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(_GENERATION_TAG.sub("", template))
    except jinja2.TemplateSyntaxError:
        return False  # such a template cannot render anything; the chat reports that error
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


# -- prompts ---------------------------------------------------------------------------------------

def prepare_chat(messages: list[dict], tools: list[dict] | None,
                 supports_tools: bool) -> tuple[list[dict], dict[str, Any]]:
    """The messages to render and the extra template kwargs for a chat that may offer tools."""
    if supports_tools:
        return [_with_parsed_arguments(m) for m in messages], ({"tools": tools} if tools else {})
    # Tool history is turned into text even without tools: this template cannot render it otherwise.
    inlined = _inline_tool_history(messages)
    return (_with_preamble(inlined, tools) if tools else inlined), {}


def _with_parsed_arguments(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _json_object(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _json_object(text: str) -> Any:
    """`text` parsed if it is a JSON object; otherwise the string itself."""
    value = _json_value(text)
    return value if isinstance(value, dict) else text


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _inline_tool_history(messages: list[dict]) -> list[dict]:
    """Assistant tool_calls as call text after the content; tool results as user turns."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant turns
    out: list[dict] = []
    after_tool = False
    for message in messages:
        if message.get("role") == "tool":
            block = _tool_response(message, names)
            if after_tool:  # results of parallel calls share one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        elif "tool_calls" in message:
            names.update((c["id"], c["function"]["name"]) for c in message["tool_calls"])
            out.append(_assistant_with_calls(message))
        else:
            out.append(message)
        after_tool = message.get("role") == "tool"
    return out


def _assistant_with_calls(message: dict) -> dict:
    calls = [format_tool_call(c["function"]["name"], c["function"]["arguments"].strip() or "{}")
             for c in message["tool_calls"]]
    text = "\n".join(part for part in [message_text(message), *calls] if part)
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text}


def _tool_response(message: dict, names: dict[str, str]) -> str:
    name = names.get(message["tool_call_id"], message.get("name"))
    result = _json_value(message_text(message))
    body = {"name": name, "content": result} if name else {"content": result}
    return "<tool_response>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_response>"


def _with_preamble(messages: list[dict], tools: list[dict]) -> list[dict]:
    preamble = TOOL_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0].get("role") in ("system", "developer"):
        first = messages[0]
        system = message_text(first)
        return [{**first, "content": f"{system}\n\n{preamble}" if system else preamble}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


# -- parsing ---------------------------------------------------------------------------------------

@dataclass
class ToolCall:
    """One call the model made; `arguments` is the JSON text exactly as generated."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The entry of an OpenAI message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """A call id as OpenAI makes them: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole generated text; content is None when empty."""
    calls: list[ToolCall] = []
    first, pos = len(text), 0
    while (begin := _BEGIN_RE.search(text, pos)) is not None:
        end = text.find(CALL_END, begin.end())
        if end < 0:  # cut off: neither this nor any later block is complete
            break
        first = min(first, begin.start())
        calls.append(ToolCall(new_call_id(), begin.group(1), text[begin.end():end]))
        pos = end + len(CALL_END)
    return text[:first].strip() or None, calls


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
    """Turns streamed text into content and call events, as `parse_tool_calls` splits the whole text.

    Held back, and only until the next delta decides it: text that may still become a call's begin
    string, a possible start of the end string inside arguments, and whitespace after content (it is
    content only if more content follows, since content is stripped).
    """

    def __init__(self) -> None:
        self._pending = ""  # text not yet turned into events
        self._in_call = False
        self._content_started = False  # until then, whitespace is leading and dropped
        self.num_calls = 0

    def feed(self, delta_text: str) -> list[StreamEvent]:
        """Events for the next piece of generated text."""
        self._pending += delta_text
        events: list[StreamEvent] = []
        while self._arguments(events) if self._in_call else self._outside(events):
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

    def _outside(self, events: list[StreamEvent]) -> bool:
        """Content (or text between calls) up to a call's begin string; True if a call began."""
        start, begin = _find_begin(self._pending)
        held = self._content(events, self._pending[:start], more_follows=begin is None)
        if begin is None:
            self._pending = held + self._pending[start:]
            return False
        events.append(ToolCallStart(self.num_calls, new_call_id(), begin.group(1)))
        self.num_calls += 1
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
        if text:
            events.append(ToolArgumentsDelta(self.num_calls - 1, text))


def _find_begin(text: str) -> tuple[int, re.Match[str] | None]:
    """Where a call's begin string is (with its match) or may still be (None); len(text) if nowhere.

    Only the first candidate matters: a begin string has "<" only at its start, so text that may still
    become one holds no later "<", and the first complete one is also the first candidate.
    """
    k = text.find("<")
    while k >= 0:
        begin = _BEGIN_RE.match(text, k)
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
