"""Tool-call formats per model family (`--tool-call-parser`), each a begin pattern and an argument reader.

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>     Hermes, Qwen2.5, Qwen3, SmolLM
    llama3_json  {"name": "f", "parameters": {...}}  (after <|python_tag|>, or not) Llama 3.1 / 3.2 JSON tools
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...], or [TOOL_CALLS]f[ARGS]{...}  Mistral
    pythonic     [f(a=1, b="x"), g()]                                             Llama 3.2 pythonic, Llama 4
    qwen3_xml    <tool_call>\\n<function=f>\\n<parameter=a>\\n1\\n</parameter>\\n</function>\\n</tool_call>   Qwen3-Coder
    phi4_mini    <|tool_call|>[{"name": "f", "arguments": {...}}, ...]<|/tool_call|>             Phi-4-mini
    gemma3       [f(a=1), g()], also inside a ```tool_code block                                Gemma 3
    harmony      <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>   gpt-oss

Matching is strict where the grammar writes the text (hermes: exactly the form above) and whitespace-tolerant
where models write it themselves (JSON keys, separators); llama3_json also takes "arguments" for "parameters".
Arguments always come back as compact JSON: the JSON formats compacted as written (not re-serialised: the
streamer cannot take back fragments it sent); pythonic and qwen3_xml converted, a parameter at a time, pythonic
values read as Python literals (JSON's true/false/null accepted too; a value that is neither becomes its source
text as a string), qwen3_xml values by the tool's JSON schema type as vLLM converts them (string, integer,
number, boolean, object/array as JSON, "null"; unknown parameters stay strings).

A reader is made per call and is fed the call's text as it grows (never anything else), so it keeps where it
got to: reading a streamed call costs its length once, not once per delta. Harmony's message framing around
content (`<|start|>assistant`, `<|channel|>final`, `<|message|>`, `<|end|>`, ...) is `markup`: never content.
`detect_format` picks the default from the chat template's own markers.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Callable

import regex

from lmserve.parsers.events import partial_suffix
from lmserve.parsers.tool_calls import Begin

NAME = r"(?P<name>[A-Za-z0-9_-]{1,64})"  # OpenAI's rule for function names (protocol.TOOL_NAME_PATTERN)
_WS = " \t\r\n"


def compact(text: str, state: list[bool] | None = None) -> str:
    """JSON text without the whitespace between tokens; `state` ([in_string, escaped]) carries across pieces."""
    s = state if state is not None else [False, False]
    out = []
    for ch in text:
        if s[0]:
            s[0] = s[1] or ch != '"'
            s[1] = not s[1] and ch == "\\"
        elif ch in _WS:
            continue
        else:
            s[0] = ch == '"'
        out.append(ch)
    return "".join(out)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _pair(key: str, value: Any, source: str) -> str:
    """`"key":value` compact; a value JSON cannot hold (an infinite number) is its source text."""
    try:
        return _dumps(key) + ":" + _dumps(value)
    except ValueError:
        return _dumps(key) + ":" + _dumps(source)


# -- readers: the text after a begin -> (arguments so far, where the call ends) ----------------------------------

class RawUntil:
    """hermes: the arguments are the raw JSON text up to a fixed end string."""

    def __init__(self, end: str) -> None:
        self.end, self.done, self.out, self.state = end, 0, "", [False, False]

    def read(self, body: str, final: bool) -> tuple[str, int | None]:
        at = body.find(self.end, self.done)  # an end string starting before `done` would have been found already
        stop = at if at >= 0 else len(body) if final else len(body) - partial_suffix(body, self.end)
        self.out += compact(body[self.done:stop], self.state)
        self.done = stop
        return self.out, (at + len(self.end) if at >= 0 else None)


class JSONValue:
    """llama3_json, mistral: one JSON value (the arguments), then the call object's "}" (a missing one is forgiven:
    whatever follows the value is text between calls)."""

    def __init__(self) -> None:
        self.pos = 0  # scanned up to here
        self.start: int | None = None  # where the value starts (after leading whitespace)
        self.depth, self.in_string, self.escaped = 0, False, False
        self.value_end: int | None = None
        self.out, self.state, self.compacted = "", [False, False], 0

    def read(self, body: str, final: bool) -> tuple[str, int | None]:
        if self.value_end is None:
            self._scan(body, final)
            if self.start is not None:
                stop = self.value_end if self.value_end is not None else len(body)
                self.out += compact(body[max(self.start, self.compacted):stop], self.state)
                self.compacted = stop
            if self.value_end is None:
                return self.out, None
        rest = body[self.value_end:].lstrip(_WS)
        if not rest:
            return self.out, (len(body) if final else None)  # the closing "}" may still come
        return self.out, (len(body) - len(rest) + 1 if rest[0] == "}" else self.value_end)

    def _scan(self, body: str, final: bool) -> None:
        """Advance through the value; sets value_end once it is complete."""
        i = self.pos
        if self.start is None:
            while i < len(body) and body[i] in _WS:
                i += 1
            self.pos = i
            if i == len(body):
                return
            self.start = i
        for j in range(i, len(body)):
            ch = body[j]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.value_end = j + 1
                        return
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif self.depth and ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.value_end = j + 1
                    return
            elif self.depth == 0 and ch in ",}] \t\r\n":  # a scalar ends here
                self.value_end = j
                return
        self.pos = len(body)
        if final and self.depth == 0 and not self.in_string:
            self.value_end = len(body)  # a scalar that runs to the end of the text


class PythonicArgs:
    """pythonic: `a=1, b="x")`: keyword arguments, each a Python literal, converted to JSON as each completes."""

    _KEY = regex.compile(r"[ \t\r\n]*(?P<key>[A-Za-z_][A-Za-z0-9_]*)[ \t\r\n]*=")
    _CLOSE = regex.compile(r"[ \t\r\n]*\)")

    def __init__(self) -> None:
        self.pos, self.pairs = 0, []  # where the next argument (or the ")") may start; the JSON pairs so far
        self.key: str | None = None  # the argument whose value is being read
        self.value_at = 0
        self.scan = _LiteralScan()

    def read(self, body: str, final: bool) -> tuple[str, int | None]:
        while True:
            if self.key is None:
                close = self._CLOSE.match(body, self.pos, partial=True)
                if close is not None and not close.partial:
                    return self._so_far() + "}", close.end()
                key = self._KEY.match(body, self.pos, partial=True)
                if key is None and close is None:  # not an argument: the call ends here (the rest is between calls)
                    return self._so_far() + "}", self.pos
                if key is None or key.partial:
                    return self._so_far(), None
                self.key, self.value_at, self.scan = key.group("key"), key.end(), _LiteralScan(key.end())
            end = self.scan.find_end(body)
            if end is None:
                return self._so_far(), None
            source = body[self.value_at:end].strip()
            self.pairs.append(_pair(self.key, _python_value(source), source))
            self.key = None
            if body[end] != ",":  # ")" ends the call; a stray "]" or "}" ends it too, unconsumed
                return self._so_far() + "}", end + (body[end] == ")")
            self.pos = end + 1

    def _so_far(self) -> str:
        return "{" + ",".join(self.pairs)


class _LiteralScan:
    """Where a Python literal ends: the first "," or unmatched ")" / "]" / "}" outside strings and brackets."""

    def __init__(self, start: int = 0) -> None:
        self.pos, self.depth, self.quote, self.escaped = start, 0, "", False

    def find_end(self, text: str) -> int | None:
        for j in range(self.pos, len(text)):
            ch = text[j]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}" and self.depth:
                self.depth -= 1
            elif ch in ",)]}" and not self.depth:
                self.pos = j
                return j
        self.pos = len(text)
        return None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _python_value(source: str) -> Any:
    """A Python (or JSON) literal's value; the source text itself when it is neither."""
    try:
        return _literal(ast.parse(source, mode="eval").body)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        return source


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value  # an infinite float is caught when written (_pair)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) in (int, float):
        return -node.operand.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError("not a literal")


class XMLParameters:
    """qwen3_xml: `<parameter=a>\\nvalue\\n</parameter>` repeated, then `</function>` and `</tool_call>`."""

    _PARAM = regex.compile(r"[ \t\r\n]*<parameter=(?P<key>[^>\n]{1,128})>")
    _END = regex.compile(r"[ \t\r\n]*</function>[ \t\r\n]*</tool_call>")
    _CLOSE = "</parameter>"

    def __init__(self, schema: dict[str, Any] | None) -> None:
        props = (schema or {}).get("properties")
        self.props: dict[str, Any] = props if isinstance(props, dict) else {}
        self.pos, self.pairs = 0, []

    def read(self, body: str, final: bool) -> tuple[str, int | None]:
        while True:
            end = self._END.match(body, self.pos, partial=True)
            if end is not None and not end.partial:
                return self._so_far() + "}", end.end()
            param = self._PARAM.match(body, self.pos, partial=True)
            if param is None and end is None:  # neither: the call ends here (the rest is text between calls)
                return self._so_far() + "}", self.pos
            if param is None or param.partial:
                return self._so_far(), None
            close = body.find(self._CLOSE, param.end())
            if close < 0:
                return self._so_far(), None
            value = body[param.end():close]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = param.group("key")
            self.pairs.append(_pair(key, xml_value(value, self.props.get(key)), value))
            self.pos = close + len(self._CLOSE)

    def _so_far(self) -> str:
        return "{" + ",".join(self.pairs)


def xml_value(text: str, schema: Any) -> Any:
    """A qwen3_xml parameter's text as its schema's type says (vLLM's conversion); a string when unknown or invalid."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if text.lower() == "null":
        return None
    if kind in (None, "string"):
        return text
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind == "boolean":
            return text.strip().lower() == "true"
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


# -- the formats ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call text: how a call begins, how its arguments are read, how a past call is written."""

    name: str
    begin: Any  # a compiled `regex` pattern with a "name" group, up to where the arguments start
    reader: Callable[[dict | None], Any]  # (the called tool's parameters schema) -> a reader with read(body, final)
    write: Callable[[str, dict | str], str]  # (name, arguments) -> the call as the model writes it
    example: str  # the call form the prompt shows a model whose template has no tools support
    continuation: Any = None  # a list format's next call right after one (", {..." / ", g(")
    keeps_special_tokens: bool = False  # its marker is a special token (mistral's [TOOL_CALLS]): keep it in the text
    markup: Any = None  # a `regex` pattern of framing that is never content (harmony's message headers and ends)
    # What may close a call's list or block right after it, each literal optional (tool_calls.match_closer): framing,
    # not content, so the text after a call starts after it.
    closer: tuple[str, ...] = ()
    # (begin, end) around each one call, when the format marks calls so (hermes, qwen3_xml): a call repeating an
    # earlier one ends the turn (SamplingParams.repeat_stop). The list formats (mistral, pythonic) and llama3_json's
    # bare JSON have no per-call end marker a text search can find, so they have none.
    call_span: tuple[str, str] | None = None

    def find_begin(self, text: str, after_call: bool) -> tuple[int, Begin | None]:
        """(where a call begins, its match) or (where one may still begin, None); (len(text), None) if nowhere."""
        if after_call and self.continuation is not None:
            m = self.continuation.match(text, partial=True)
            if m is not None:
                return 0, (None if m.partial else m)
        m = self.begin.search(text, partial=True)
        if m is None:
            return len(text), None
        return m.start(), (None if m.partial else m)

    def format_call(self, name: str, arguments: str) -> str:
        """One past call as the model writes it (`arguments`: the JSON text a client sent back)."""
        return self.write(name, arguments)


def _json_args(arguments: str) -> str:
    return arguments.strip() or "{}"


def _loads(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _python_literal(value: Any) -> str:
    """A JSON value written as a Python literal (the pythonic format's values)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_python_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _write_pythonic(name: str, arguments: str) -> str:
    args = ", ".join(f"{k}={_python_literal(v)}" for k, v in _loads(arguments).items())
    return f"[{name}({args})]"


def _write_xml(name: str, arguments: str) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                     "</parameter>\n" for k, v in _loads(arguments).items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


_JSON_CALL = r'\{[ \t\r\n]*"name"[ \t\r\n]*:[ \t\r\n]*"' + NAME + r'"[ \t\r\n]*,[ \t\r\n]*"(?:%s)"[ \t\r\n]*:'
HERMES_BEGIN, HERMES_NAME_END, HERMES_END = '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"

HERMES = ToolFormat(
    "hermes", regex.compile(regex.escape(HERMES_BEGIN) + NAME + regex.escape(HERMES_NAME_END)),
    lambda schema: RawUntil(HERMES_END),
    lambda name, args: HERMES_BEGIN + name + HERMES_NAME_END + _json_args(args) + HERMES_END,
    '<tool_call>\n{"name": "<function name>", "arguments": <the arguments as a JSON object>}\n</tool_call>',
    call_span=("<tool_call>", "</tool_call>"))
LLAMA3_JSON = ToolFormat(
    "llama3_json", regex.compile(r"(?:<\|python_tag\|>[ \t\r\n]*)?" + _JSON_CALL % "parameters|arguments"),
    lambda schema: JSONValue(),
    lambda name, args: '{"name": "' + name + '", "parameters": ' + _json_args(args) + "}",
    '{"name": "<function name>", "parameters": <the arguments as a JSON object>}', closer=(";",))
MISTRAL = ToolFormat(  # the JSON-list form (v3 tokenizers) and the name[ARGS] form (v11+: one marker per call)
    "mistral", regex.compile(r"\[TOOL_CALLS\][ \t\r\n]*(?:\[[ \t\r\n]*" + _JSON_CALL % "arguments" + "|" + NAME
                             + r"(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\])"),
    lambda schema: JSONValue(),
    lambda name, args: '[TOOL_CALLS][{"name": "' + name + '", "arguments": ' + _json_args(args) + "}]",
    '[TOOL_CALLS][{"name": "<function name>", "arguments": <the arguments as a JSON object>}]',
    continuation=regex.compile(r"[ \t\r\n]*,[ \t\r\n]*" + _JSON_CALL % "arguments"), keeps_special_tokens=True,
    closer=("]",))
PHI4_MINI = ToolFormat(
    "phi4_mini", regex.compile(r"<\|tool_call\|>[ \t\r\n]*\[[ \t\r\n]*" + _JSON_CALL % "arguments|parameters"),
    lambda schema: JSONValue(),
    lambda name, args: '<|tool_call|>[{"name": "' + name + '", "arguments": ' + _json_args(args) + "}]<|/tool_call|>",
    '<|tool_call|>[{"name": "<function name>", "arguments": <the arguments as a JSON object>}]<|/tool_call|>',
    continuation=regex.compile(r"[ \t\r\n]*,[ \t\r\n]*" + _JSON_CALL % "arguments|parameters"),
    keeps_special_tokens=True, closer=("]", "<|/tool_call|>"))
PYTHONIC = ToolFormat(
    "pythonic", regex.compile(r"\[[ \t\r\n]*" + NAME + r"\("), lambda schema: PythonicArgs(), _write_pythonic,
    '[<function name>(<argument name>=<value>, ...)]',
    continuation=regex.compile(r"[ \t\r\n]*,[ \t\r\n]*" + NAME + r"\("), closer=("]",))
QWEN3_XML = ToolFormat(
    "qwen3_xml", regex.compile(r"<tool_call>[ \t\r\n]*<function=" + NAME + ">"), XMLParameters, _write_xml,
    "<tool_call>\n<function=<function name>>\n<parameter=<argument name>>\n<value>\n</parameter>\n</function>\n"
    "</tool_call>", call_span=("<tool_call>", "</tool_call>"))

GEMMA3 = ToolFormat(  # Gemma 3's documented list of Python calls, also inside a ```tool_code block
    "gemma3", regex.compile(r"(?:```tool_code[ \t\r\n]*\[?|\[)[ \t\r\n]*" + NAME + r"\("),
    lambda schema: PythonicArgs(), _write_pythonic, '[<function name>(<argument name>=<value>, ...)]',
    continuation=regex.compile(r"[ \t\r\n]*,[ \t\r\n]*" + NAME + r"\("), closer=("]", "```"))
HARMONY_CALL = "<|channel|>commentary to=functions."
HARMONY = ToolFormat(  # gpt-oss: a call is a commentary-channel message to functions.NAME, ended by <|call|>
    "harmony", regex.compile(r"(?:<\|start\|>assistant[ ]*)?(?:<\|channel\|>commentary[ ]*)?to=functions\." + NAME
                             + r"[ ]*(?:<\|channel\|>commentary[ ]*)?(?:<\|constrain\|>[ ]*)?(?:json[ ]*)?"
                             + r"<\|message\|>"),
    lambda schema: RawUntil("<|call|>"),
    lambda name, args: HARMONY_CALL + name + " <|constrain|>json<|message|>" + _json_args(args) + "<|call|>",
    HARMONY_CALL + "<function name> <|constrain|>json<|message|><the arguments as a JSON object><|call|>",
    keeps_special_tokens=True, call_span=("to=functions.", "<|call|>"),
    markup=regex.compile(r"<\|start\|>assistant|<\|channel\|>(?:analysis|commentary|final)|<\|constrain\|>json"
                         r"|<\|(?:message|end|return|call)\|>"))

TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, QWEN3_XML,
                                                              PHI4_MINI, GEMMA3, HARMONY)}

# A chat template's own tool-call markers -> its family, first match wins (Qwen3-Coder's template also writes
# <tool_call>, Llama 4's also names <|python_tag|>). A template with none of them (SmolLM2's ChatML) gets hermes:
# the form the tool preamble teaches.
_TEMPLATE_MARKERS = (("harmony", "<|channel|>"), ("qwen3_xml", "<parameter="), ("hermes", "<tool_call>"),
                     ("phi4_mini", "<|tool_call|>"), ("phi4_mini", "<|tool|>"), ("mistral", "[TOOL_CALLS]"),
                     ("pythonic", "<|python_start|>"), ("pythonic", "[func_name1("),
                     ("llama3_json", "<|python_tag|>"), ("llama3_json", '"parameters": '),
                     ("gemma3", "<start_of_turn>"))


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template's source names (hermes when it names none)."""
    return next((name for name, marker in _TEMPLATE_MARKERS if marker in (template or "")), "hermes")


def resolve_format(name: str | None, template: str | None) -> ToolFormat:
    """The format a server uses: the --tool-call-parser flag, else the chat template's."""
    return TOOL_FORMATS[name or detect_format(template)]

