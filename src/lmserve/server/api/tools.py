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

Parsing (`parse_tool_calls`): a call counts once its begin string (with a valid function name) and
its end string are both there; the arguments are the raw text between, not validated or
re-serialised (the grammar guarantees them, and the streamer, `tool_stream.py`, could not take back
fragments it already sent). Content is the text before the first call, stripped; text between or
after calls is dropped. A call cut off before its end (max_tokens) is not a call: without any
complete call the whole text is content, since a call whose arguments are not complete JSON would
break a client's json.loads.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from lmserve.tokenizer.chat_template import message_text
from lmserve.server.protocol import TOOL_NAME_PATTERN
from lmserve.structured.tool_tag import ARGUMENTS_PREFIX, CALL_CLOSE, CALL_END, CALL_OPEN, NAME_PREFIX

# One definition of the format, shared with the grammar that constrains it (structured/tool_tag.py).
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = CALL_OPEN, CALL_CLOSE
CALL_BEGIN = CALL_OPEN + NAME_PREFIX  # then the name
NAME_END = ARGUMENTS_PREFIX  # then the arguments object
# CALL_END: "}\n</tool_call>"; its "}" closes the {"name": ...} object

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

# A complete begin string; group 1 is the name. "<" is its first character and appears nowhere else in it.
CALL_BEGIN_RE = re.compile(re.escape(CALL_BEGIN) + f"({TOOL_NAME_PATTERN})" + re.escape(NAME_END))
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
    return "tools" in template_variables(template)


@lru_cache(maxsize=16)  # asked per request, about the few templates the server has
def template_variables(template: str | None) -> frozenset[str]:
    """The variables a chat template's Jinja source reads from its caller (`tools`, `enable_thinking`, ...)."""
    if not template:
        return frozenset()
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(_GENERATION_TAG.sub("", template))
    except jinja2.TemplateSyntaxError:
        return frozenset()  # such a template cannot render anything; the chat reports that error
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


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

class CompactJSON:
    """Drops the whitespace between JSON tokens, fed in pieces: `{\n "city": "Paris"\n}` -> `{"city":"Paris"}`.

    Tool-call arguments come back compact, as OpenAI sends them, whatever whitespace the grammar let the model
    write. Strings are kept as they are (escapes included); the state carries across pieces, so a stream's
    fragments join to exactly what the whole text gives.
    """

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if self.in_string:
                self.in_string = self.escaped or ch != '"'
                self.escaped = not self.escaped and ch == "\\"
            elif ch in " \t\r\n":
                continue
            else:
                self.in_string = ch == '"'
            out.append(ch)
        return "".join(out)


@dataclass
class ToolCall:
    """One call the model made; `arguments` is its JSON text as generated, compacted (CompactJSON)."""

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
    while (begin := CALL_BEGIN_RE.search(text, pos)) is not None:
        end = text.find(CALL_END, begin.end())
        if end < 0:  # cut off: neither this nor any later block is complete
            break
        first = min(first, begin.start())
        calls.append(ToolCall(new_call_id(), begin.group(1), CompactJSON().feed(text[begin.end():end])))
        pos = end + len(CALL_END)
    return text[:first].strip() or None, calls
