"""The grammar of each tool-call format, as an xgrammar structural tag (tool_choice auto, required, named).

tool_choice "auto": free text in which the format's trigger switches the grammar on for one call block (the
name one of the tools', the arguments following its JSON schema), then free text again. "required": the output is
only calls (at least one). A named function: exactly one call of it, then only a stop token (EOS), whatever
parallel_tool_calls says. parallel_tool_calls false: at most one call. Each format's
text is exactly what its parser (tool_formats.py) reads:

    hermes       <tool_call>\\n{"name": "f", "arguments": ARGS}\\n</tool_call>, calls joined by "\\n"
    llama3_json  {"name": "f", "parameters": ARGS}, calls joined by "; " (auto: triggered by '{"name": ')
    mistral      [TOOL_CALLS][{"name": "f", "arguments": ARGS}, ...]  (auto: one block, triggered by [TOOL_CALLS])
    pythonic     [f(a=1, b="x"), g()]  (auto: one call per list, triggered by "[f(" for each tool f)
    qwen3_xml    <tool_call>\\n<function=f>\\n PARAMS \\n</function>\\n</tool_call> (xgrammar's qwen_xml parameters)
    phi4_mini    <|tool_call|>[{"name": "f", "arguments": ARGS}, ...]<|/tool_call|>  (auto: triggered by <|tool_call|>)
    gemma3       as pythonic (Gemma 3's documented call list)
    harmony      <|channel|>commentary to=functions.f <|constrain|>json<|message|>ARGS<|call|>, joined by
                 "<|start|>assistant" (auto: triggered by "<|channel|>commentary to=functions.")

pythonic arguments: the schema's required properties in order, then its optional ones (each may be left out),
each `name=value` with the value a JSON value of the property's schema (valid Python for strings, numbers,
lists and objects), True/False for a boolean and None for a null property.
"""

from __future__ import annotations

import json
from typing import Any

from lmserve.parsers.tool_formats import HARMONY_CALL, HERMES_BEGIN, HERMES_END, HERMES_NAME_END
from lmserve.structured.compiler import GrammarError
from lmserve.structured.schema import unsupported_keywords

MAX_WHITESPACE = 2  # consecutive whitespace inside arguments: a sampling model cannot run off into spaces


def tool_call_tag(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool = True,
                  fmt: str = "hermes") -> str:
    """Structural-tag JSON for OpenAI `tools` (function dicts) under `tool_choice` ("auto", "required", named)."""
    if isinstance(tool_choice, dict):  # exactly one call, then only a stop token (as vLLM's named choice)
        name = tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        parallel = False
    functions = [t["function"] for t in tools]
    for function in functions:
        _check(function)
    auto, required = _FORMATS[fmt]
    body = auto(functions, parallel) if tool_choice == "auto" else required(functions, parallel)
    return json.dumps({"type": "structural_tag", "format": body}, ensure_ascii=False)


def _check(function: dict[str, Any]) -> None:
    bad = unsupported_keywords(_parameters(function))
    if bad:
        raise GrammarError(f"tool {function['name']!r}: parameters use keyword(s) structured outputs cannot "
                           f"enforce: {', '.join(bad)}")


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def _json(schema: Any, style: str = "json") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE, "style": style}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _triggered(triggers: list[str], tags: list[dict], parallel: bool) -> dict[str, Any]:
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": False,
            "stop_after_first": not parallel}


def _separated(tags: list[dict], separator: str, parallel: bool) -> dict[str, Any]:
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel}


# -- per format: (auto, required) builders over the tools' function dicts ---------------------------------------

def _hermes_tag(f: dict) -> dict:
    return _tag(HERMES_BEGIN + f["name"] + HERMES_NAME_END, _json(_parameters(f)), HERMES_END)


def _llama_tag(f: dict) -> dict:
    return _tag('{"name": "' + f["name"] + '", "parameters": ', _json(_parameters(f)), "}")


def _mistral_tag(f: dict) -> dict:
    return _tag('{"name": "' + f["name"] + '", "arguments": ', _json(_parameters(f)), "}")


def _xml_tag(f: dict) -> dict:
    return _tag("<tool_call>\n<function=" + f["name"] + ">\n", _json(_parameters(f), "qwen_xml"),
                "\n</function>\n</tool_call>")


def _mistral_block(functions: list[dict], parallel: bool) -> dict:
    return _tag("[TOOL_CALLS][", _separated([_mistral_tag(f) for f in functions], ", ", parallel), "]")


def _phi4_block(functions: list[dict], parallel: bool) -> dict:
    return _tag("<|tool_call|>[", _separated([_mistral_tag(f) for f in functions], ", ", parallel), "]<|/tool_call|>")


def _harmony_tag(f: dict) -> dict:
    return _tag(HARMONY_CALL + f["name"] + " <|constrain|>json<|message|>", _json(_parameters(f)), "<|call|>")


def _pythonic_tag(f: dict, prefix: str = "", suffix: str = "") -> dict:
    return _tag(prefix + f["name"] + "(", _kwargs(_parameters(f)), ")" + suffix)


def _kwargs(schema: dict[str, Any]) -> dict[str, Any]:
    """`name=value, ...` for an object schema's properties: the required ones in order, then each optional one."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [k for k in schema.get("required", []) if k in props]
    optional = [k for k in props if k not in required]
    items: list[dict] = []
    for i, k in enumerate(required):
        items += [_const((", " if i else "") + k + "="), _python_value(props[k])]
    if required:
        items += [{"type": "optional", "content": _seq([_const(", " + k + "="), _python_value(props[k])])}
                  for k in optional]
    elif optional:  # any subset in order: the first one present has no comma before it
        firsts = [_seq([_const(k + "="), _python_value(props[k]),
                        *({"type": "optional", "content": _seq([_const(", " + o + "="), _python_value(props[o])])}
                          for o in optional[i + 1:])]) for i, k in enumerate(optional)]
        items.append({"type": "optional", "content": {"type": "or", "elements": firsts}})
    return _seq(items) if items else _const("")


def _seq(elements: list[dict]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _python_value(schema: Any) -> dict[str, Any]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean":
        return {"type": "or", "elements": [_const("True"), _const("False")]}
    if kind == "null":
        return _const("None")
    return _json(schema)


def _pythonic_auto(fs: list[dict], p: bool) -> dict:
    return _triggered(["[" + f["name"] + "(" for f in fs], [_pythonic_tag(f, "[", "]") for f in fs], p)


def _pythonic_required(fs: list[dict], p: bool) -> dict:
    return _seq([_const("["), _separated([_pythonic_tag(f) for f in fs], ", ", p), _const("]")])


_FORMATS = {
    "hermes": (lambda fs, p: _triggered([HERMES_BEGIN[:len("<tool_call>")]], [_hermes_tag(f) for f in fs], p),
               lambda fs, p: _separated([_hermes_tag(f) for f in fs], "\n", p)),
    "llama3_json": (lambda fs, p: _triggered(['{"name": '], [_llama_tag(f) for f in fs], p),
                    lambda fs, p: _separated([_llama_tag(f) for f in fs], "; ", p)),
    "mistral": (lambda fs, p: _triggered(["[TOOL_CALLS]"], [_mistral_block(fs, p)], p),
                lambda fs, p: _mistral_block(fs, p)),
    "pythonic": (_pythonic_auto, _pythonic_required),
    "gemma3": (_pythonic_auto, _pythonic_required),
    "phi4_mini": (lambda fs, p: _triggered(["<|tool_call|>"], [_phi4_block(fs, p)], p), _phi4_block),
    "harmony": (lambda fs, p: _triggered([HARMONY_CALL], [_harmony_tag(f) for f in fs], p),
                lambda fs, p: _separated([_harmony_tag(f) for f in fs], "<|start|>assistant", p)),
    "qwen3_xml": (lambda fs, p: _triggered(["<tool_call>"], [_xml_tag(f) for f in fs], p),
                  lambda fs, p: _separated([_xml_tag(f) for f in fs], "\n", p)),
}
