"""Tool calling, server side: prompts that offer tools, in the server's tool-call format (parsers/tool_formats.py).

The format is `--tool-call-parser`, else the chat template's family (`tool_format`); the grammar that constrains
calls (parsers/tool_grammar.py) and the parser that reads them back (parsers/tool_calls.py) follow the same one.

Prompting (`prepare_chat`): a template that reads a `tools` variable gets the OpenAI tool dicts as that variable,
and assistant `tool_calls` keep their structure (arguments parsed into a dict, as transformers templates expect):
the template writes its own family's instructions. A template without one (SmolLM2's ChatML) gets the history as
text instead: the tool preamble goes at the end of the system message (a new one is put first if the chat has
none). The preamble tells the model it may call functions, lists each tool as one JSON line between <tools> and
</tools>, shows the format's call form (hermes: one <tool_call> block per call), says that results come back
between <tool_response> tags, and that it should answer directly when no call is needed. Past calls become the
format's call text after the assistant's content; tool results become a user turn of `<tool_response>` blocks
(consecutive results share one turn), each a JSON object with the function's name (found through tool_call_id)
and the result (embedded as JSON when it parses as JSON).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from lmserve.parsers.output import OutputParser
from lmserve.parsers.reasoning import ReasoningParser
from lmserve.parsers.tool_formats import HERMES, ToolFormat, resolve_format
from lmserve.server.served import ModelState
from lmserve.tokenizer.chat_template import message_text

TOOL_PREAMBLE = """You may call one or more functions to help with the user's request. \
The functions are listed below, one JSON object per line, between <tools> and </tools>:
<tools>
{tools}
</tools>

To call a function, write a block in exactly this form, one block per call:
{example}
The result of each call comes back to you between <tool_response> and </tool_response>. \
If no function is needed, answer directly."""

_GENERATION_TAG = re.compile(r"{%-?\s*(end)?generation\s*-?%}")  # a tag only our renderer knows


def tool_format(st: ModelState) -> ToolFormat:
    """The model's tool-call format: --tool-call-parser, else its chat template's family."""
    return resolve_format(st.config.tool_call_parser, st.front.tokenizer.chat_template)


def output_parser(tools: list[dict], fmt: ToolFormat, reasoning: ReasoningParser | None) -> OutputParser | None:
    """What reads a reply back into parts: its reasoning, and calls when the request offers `tools` (None: neither,
    the reply is plain text)."""
    if not tools and reasoning is None:
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    return OutputParser(reasoning, fmt if tools else None, schemas)


def tool_preamble(tools: list[dict], fmt: ToolFormat = HERMES) -> str:
    """The system-message text that offers `tools` to a model whose template cannot list them."""
    return TOOL_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools), example=fmt.example)


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template's Jinja source reads a `tools` variable."""
    return "tools" in template_variables(template)


@lru_cache(maxsize=16)  # asked per request, about the few templates the server has
def template_variables(template: str | None) -> frozenset[str]:
    """The variables a chat template's Jinja source reads from its caller (`tools`, `enable_thinking`, ...)."""
    if not template:
        return frozenset()
    import jinja2  # here, not at import: no start pays for jinja2 (issue 32)
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(_GENERATION_TAG.sub("", template))
    except jinja2.TemplateSyntaxError:
        return frozenset()  # such a template cannot render anything; the chat reports that error
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


# -- prompts ---------------------------------------------------------------------------------------

def prepare_chat(messages: list[dict], tools: list[dict] | None, supports_tools: bool,
                 fmt: ToolFormat = HERMES) -> tuple[list[dict], dict[str, Any]]:
    """The messages to render and the extra template kwargs for a chat that may offer tools."""
    if supports_tools:
        return [_with_parsed_arguments(m) for m in messages], ({"tools": tools} if tools else {})
    # Tool history is turned into text even without tools: this template cannot render it otherwise.
    inlined = _inline_tool_history(messages, fmt)
    return (_with_preamble(inlined, tools, fmt) if tools else inlined), {}


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


def _inline_tool_history(messages: list[dict], fmt: ToolFormat) -> list[dict]:
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
            out.append(_assistant_with_calls(message, fmt))
        else:
            out.append(message)
        after_tool = message.get("role") == "tool"
    return out


def _assistant_with_calls(message: dict, fmt: ToolFormat) -> dict:
    calls = [fmt.format_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    text = "\n".join(part for part in [message_text(message), *calls] if part)
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text}


def _tool_response(message: dict, names: dict[str, str]) -> str:
    name = names.get(message["tool_call_id"], message.get("name"))
    result = _json_value(message_text(message))
    body = {"name": name, "content": result} if name else {"content": result}
    return "<tool_response>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_response>"


def _with_preamble(messages: list[dict], tools: list[dict], fmt: ToolFormat) -> list[dict]:
    preamble = tool_preamble(tools, fmt)
    if messages and messages[0].get("role") in ("system", "developer"):
        first = messages[0]
        system = message_text(first)
        return [{**first, "content": f"{system}\n\n{preamble}" if system else preamble}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]
