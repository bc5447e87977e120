"""The grammar of OpenAI tool calls, as an xgrammar structural tag.

A call is written in the Hermes / Qwen style that many chat models were trained on:

    <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>

tool_choice "auto": free text in which "<tool_call>" switches the grammar on for one call (the name
is one of the tools', the arguments follow its JSON schema), then free text again. "required" and a
named function: the output is only calls (at least one, joined by newlines). parallel_tool_calls
false: at most one call.
"""

from __future__ import annotations

import json
from typing import Any

from lmserve.structured.compiler import GrammarError
from lmserve.structured.schema import unsupported_keywords

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
NAME_PREFIX = '\n{"name": "'
ARGUMENTS_PREFIX = '", "arguments": '
CALL_END = "}\n" + CALL_CLOSE
MAX_WHITESPACE = 2  # consecutive whitespace inside arguments: a sampling model cannot run off into spaces


def tool_call_tag(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool = True) -> str:
    """Structural-tag JSON for OpenAI `tools` (function dicts) under `tool_choice` ("auto", "required", named)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
    tags = [_tag(t["function"]) for t in tools]
    if tool_choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags, "at_least_one": False,
               "stop_after_first": not parallel}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _tag(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters") or {"type": "object"}
    bad = unsupported_keywords(schema)
    if bad:
        raise GrammarError(f"tool {function['name']!r}: parameters use keyword(s) structured outputs cannot "
                           f"enforce: {', '.join(bad)}")
    return {"type": "tag", "begin": CALL_OPEN + NAME_PREFIX + function["name"] + ARGUMENTS_PREFIX,
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
            "end": CALL_END}
