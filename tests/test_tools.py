"""Tool calling, server side: request validation, prompts with tools (server/api/tools.py), hermes calls parsed back
(parsers/tool_calls.py with parsers/tool_formats.HERMES), OpenAI chunk entries (server/api/tool_stream.py)."""

from __future__ import annotations

import json
import random
import re

import pytest

from lmserve.loader.default_model import default_model_path
from lmserve.parsers.events import ContentDelta, ToolArgumentsDelta, ToolCallStart
from lmserve.parsers.tool_calls import ToolCall, new_call_id
from lmserve.parsers.tool_calls import ToolCallStreamer as _Streamer
from lmserve.parsers.tool_calls import parse_tool_calls as _parse
from lmserve.parsers.tool_formats import HERMES
from lmserve.parsers.tool_formats import HERMES_BEGIN as CALL_BEGIN
from lmserve.parsers.tool_formats import HERMES_END as CALL_END
from lmserve.parsers.tool_formats import HERMES_NAME_END as NAME_END
from lmserve.server.api.tool_stream import chat_chunk_delta, chat_chunk_deltas, chat_chunk_tool_calls
from lmserve.server.api.tools import prepare_chat, template_supports_tools, tool_preamble
from lmserve.server.errors import APIError
from lmserve.server.protocol import ChatRequest, parse_body
from lmserve.tokenizer import Tokenizer

# The hermes format's begin string, complete (group 1: the name)
CALL_BEGIN_RE = re.compile(re.escape(CALL_BEGIN) + "([A-Za-z0-9_-]{1,64})" + re.escape(NAME_END))


def ToolCallStreamer() -> _Streamer:
    return _Streamer(HERMES)


def parse_tool_calls(text: str):
    return _parse(text, HERMES)


def call_begin(name: str) -> str:
    return CALL_BEGIN + name + NAME_END


def format_tool_call(name: str, arguments: str) -> str:
    return call_begin(name) + arguments + CALL_END

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "hi"}]
CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
HISTORY = [{"role": "user", "content": "Weather and time in Paris?"}, CALLS,
           {"role": "tool", "tool_call_id": "call_a", "content": '{"temp_c": 21}'},
           {"role": "tool", "tool_call_id": "call_b", "content": "10:42"}]


def chat(**fields) -> ChatRequest:
    return parse_body(json.dumps({"model": "m", "messages": USER, **fields}).encode(), ChatRequest)


# -- protocol --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"tools": [], "tool_choice": "none"},  # what SDKs send by default
    {"tool_choice": "none"}, {"tool_choice": "auto"},
    {"tools": None, "tool_choice": None, "parallel_tool_calls": None},
    {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [{"type": "function", "function": {"name": "a-b_9", "description": None, "strict": True}}]},
    {"messages": USER + [CALLS, *HISTORY[2:]]},
])
def test_tool_requests_accepted(fields):
    chat(**fields)


@pytest.mark.parametrize("fields,param,match", [
    ({"tools": [WEATHER, WEATHER]}, "tools", "duplicate function name 'get_weather'"),
    ({"tool_choice": "required"}, "tool_choice", "'required' needs a non-empty tools list"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs a non-empty tools list"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs a non-empty tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "function 'get_time' is not in tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "tool_choice must be 'none', 'auto'"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters", "dictionary"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id is required in a tool message"),
    ({"messages": [{"role": "tool", "content": None, "tool_call_id": "c"}]}, "messages.0", "content must not be null"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0",
     "tool_call_id is only allowed in tool messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": CALLS["tool_calls"]}]}, "messages.0",
     "tool_calls is only allowed in assistant messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                          "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "required"),
])
def test_tool_requests_refused(fields, param, match):
    with pytest.raises(APIError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param and match in e.value.message
    assert e.value.message.startswith(param)


# -- prompts ---------------------------------------------------------------------------------------

TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}|{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
                  "{% for c in m.tool_calls or [] %}[{{ c.function.name }} city={{ c.function.arguments.city }}]"
                  "{% endfor %}|{% endfor %}")


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def test_template_supports_tools(smol):
    assert not template_supports_tools(smol.chat_template)  # SmolLM2's ChatML has no tool section
    assert template_supports_tools(TOOLS_TEMPLATE)
    assert template_supports_tools("{% generation %}{{ tools | tojson }}{% endgeneration %}")
    assert not template_supports_tools("{{ 'Use the tools you have' }}{% set tools = [] %}{{ tools }}")
    assert not template_supports_tools("{% if tools %}")  # does not compile
    assert not template_supports_tools(None) and not template_supports_tools("")


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_leaves_a_plain_chat_alone(tools):
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    assert prepare_chat(messages, tools, supports_tools=False) == (messages, {})
    assert prepare_chat(messages, tools, supports_tools=True) == (messages, {})


def test_preamble_joins_the_system_message_or_comes_first():
    listed = "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>"
    preamble = tool_preamble([WEATHER, TIME])
    assert listed in preamble and format_tool_call("<function name>", "<the arguments as a JSON object>") \
        .replace(CALL_END, "}\n</tool_call>") in preamble
    system = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER]
    messages, kwargs = prepare_chat(system, [WEATHER, TIME], supports_tools=False)
    assert kwargs == {} and messages == [{"role": "system", "content": "Be brief.\n\n" + preamble}, *USER]
    messages, _ = prepare_chat(USER, [WEATHER, TIME], supports_tools=False)
    assert messages == [{"role": "system", "content": preamble}, *USER]


def test_history_becomes_text_without_tool_support():
    messages, kwargs = prepare_chat(HISTORY, None, supports_tools=False)
    assert kwargs == {} and messages[0] == HISTORY[0]
    assert messages[1] == {"role": "assistant", "content": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')}
    # Results of parallel calls share one user turn; each names its function through tool_call_id.
    assert messages[2:] == [{"role": "user", "content": (
        '<tool_response>\n{"name": "get_weather", "content": {"temp_c": 21}}\n</tool_response>\n'
        '<tool_response>\n{"name": "get_time", "content": "10:42"}\n</tool_response>')}]


def test_history_text_keeps_content_and_falls_back_for_unknown_ids():
    said = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": ""}}]}
    orphan = {"role": "tool", "tool_call_id": "nope", "content": [{"type": "text", "text": "ok"}]}
    named = {"role": "tool", "tool_call_id": "nope", "name": "legacy", "content": "1"}
    messages, _ = prepare_chat([*USER, said, orphan, *USER, named], None, supports_tools=False)
    assert messages[1]["content"] == 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert messages[2] == {"role": "user", "content": '<tool_response>\n{"content": "ok"}\n</tool_response>'}
    assert messages[4] == {"role": "user", "content": '<tool_response>\n{"name": "legacy", "content": 1}\n'
                                                      '</tool_response>'}


def test_smollm_renders_a_tool_history(smol):
    messages, kwargs = prepare_chat(HISTORY, [WEATHER, TIME], template_supports_tools(smol.chat_template))
    text = smol.apply_chat_template(messages, **kwargs)
    preamble = tool_preamble([WEATHER, TIME])
    assert text == (
        f"<|im_start|>system\n{preamble}<|im_end|>\n"
        "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"name": "get_weather", "content": {"temp_c": 21}}\n</tool_response>\n'
        '<tool_response>\n{"name": "get_time", "content": "10:42"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")
    assert smol.decode(smol.encode_chat(messages, **kwargs), skip_special_tokens=False) == text


def test_template_with_tools_gets_them_as_the_kwarg(smol):
    tok = Tokenizer(smol._hf, smol.special_tokens, chat_template=TOOLS_TEMPLATE)
    messages, kwargs = prepare_chat(HISTORY, [WEATHER, TIME], template_supports_tools(tok.chat_template))
    assert kwargs == {"tools": [WEATHER, TIME]}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # parsed, as templates expect
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the input is not changed
    assert tok.apply_chat_template(messages, add_generation_prompt=False, **kwargs) == (
        "TOOLS: get_weather get_time|user: Weather and time in Paris?|"
        "assistant: [get_weather city=Paris][get_time city=]|tool: {\"temp_c\": 21}|tool: 10:42|")


def test_unparseable_arguments_stay_strings():
    bad = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
        {"id": "d", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}
    messages, _ = prepare_chat([*USER, bad], [WEATHER], supports_tools=True)
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == ["[1, 2]", "{oops"]


# -- parsing whole texts ---------------------------------------------------------------------------

def call(name: str, args: str) -> str:
    return format_tool_call(name, args)


def test_call_format():
    assert CALL_BEGIN + "f" + NAME_END == call_begin("f") == '<tool_call>\n{"name": "f", "arguments": '
    assert call("f", '{"a": 1}') == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_call_ids_and_openai_shape():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert ToolCall("call_x", "f", '{"a":1}').to_openai() == {
        "id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


NESTED = '{"q": "a}\\n</tool_call> <tool_call>", "deep": {"x": [{"y": {}}]}}'
NESTED_COMPACT = '{"q":"a}\\n</tool_call> <tool_call>","deep":{"x":[{"y":{}}]}}'  # strings keep their spaces
# Arguments come back compact, as OpenAI sends them (whatever whitespace the model wrote between tokens).
PARSE_CASES = [
    ("plain answer", "plain answer", []),
    ("  \n spaced answer \n", "spaced answer", []),
    ("", None, []),
    (call("get_weather", '{"city": "Paris"}'), None, [("get_weather", '{"city":"Paris"}')]),
    (call("get_weather", '{\n "city": "Paris"\n}'), None, [("get_weather", '{"city":"Paris"}')]),
    (call("f", '{"s": "a \\" b", "t": "\\\\"}'), None, [("f", '{"s":"a \\" b","t":"\\\\"}')]),  # escapes
    ("Let me check.\n\n" + call("f", "{}"), "Let me check.", [("f", "{}")]),
    (call("f", '{"a": 1}') + "\n" + call("g", '{ "b" : [1, 2] }\n'), None,
     [("f", '{"a":1}'), ("g", '{"b":[1,2]}')]),
    (call("f", NESTED), None, [("f", NESTED_COMPACT)]),  # end markers inside JSON strings cannot hold a raw newline
    # text between and after calls is content too: each segment stripped, joined by a blank line (SEGMENT_SEP)
    (call("f", "{}") + " trailing text " + call("g", "{}") + "after", "trailing text\n\nafter",
     [("f", "{}"), ("g", "{}")]),
    ("Let me check.\n" + call("f", "{}") + "\nIt is sunny.\n", "Let me check.\n\nIt is sunny.", [("f", "{}")]),
    (call("f", "{}") + "\nIt is sunny,\n\n  and warm. \n", "It is sunny,\n\n  and warm.", [("f", "{}")]),
    (call("f", "{}") + "\n \n" + call("g", "{}") + "\n", None, [("f", "{}"), ("g", "{}")]),  # whitespace: none
    # cut off (max_tokens): not a call, so the text stays content
    ("Sure. " + call_begin("f") + '{"city": "Pa', "Sure. " + call_begin("f") + '{"city": "Pa', []),
    (call_begin("f") + '{"a": 1}}\n</tool_c', call_begin("f") + '{"a": 1}}\n</tool_c', []),
    (call("f", "{}") + "\n" + call_begin("g") + "{", None, [("f", "{}")]),
    # not the exact format: text
    ('<tool_call>\n{"name": "has space", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "has space", "arguments": {}}\n</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
     []),
    ("a < b <tool_ c" + call("f", "{}"), "a < b <tool_ c", [("f", "{}")]),
    ("<tool_call>\n" + call("f", "{}"), "<tool_call>", [("f", "{}")]),
]


@pytest.mark.parametrize("text,content,calls", PARSE_CASES)
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


# -- streaming -------------------------------------------------------------------------------------

def streamed(pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from a streamer fed `pieces`; checks the events' own invariants."""
    streamer = ToolCallStreamer()
    events = [e for piece in pieces for e in streamer.feed(piece)] + streamer.finish()
    content, calls, segment_calls = "", [], None  # the number of calls when the current segment began
    for e in events:
        if isinstance(e, ContentDelta):
            new_segment = segment_calls != len(calls)
            assert e.text and (not new_segment or e.text == e.text.strip()), "a segment is stripped"
            assert e.sep == ("\n\n" if new_segment and content else ""), "a separator begins each later segment"
            content += e.joined
            segment_calls = len(calls)
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls) and re.fullmatch(r"call_[A-Za-z0-9]{24}", e.id)
            calls.append([e.name, ""])
        else:
            assert e.text and e.index == len(calls) - 1, "arguments belong to the call that began last"
            calls[-1][1] += e.text
    assert streamer.num_calls == len(calls)
    return content or None, [tuple(c) for c in calls]


def parsed(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c.name, c.arguments) for c in calls]


def ends_inside_call(text: str) -> bool:
    """Whether a call begins and never ends (the one case where streaming cannot agree with parsing)."""
    pos = 0
    while (m := CALL_BEGIN_RE.search(text, pos)) is not None:
        end = text.find(CALL_END, m.end())
        if end < 0:
            return True
        pos = end + len(CALL_END)
    return False


def random_splits(text: str, rng: random.Random, count: int) -> list[list[str]]:
    out = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


COMPLETE = [text for text, _, _ in PARSE_CASES if not ends_inside_call(text)] + [
    "  Hi there.  \n" + call("get_weather", '{"city": "Paris", "n": {"a": "}"}}') + "\n\n" + call("x-y_1", "{}  "),
    "}}\n</tool_call> <tool_call> not a call \n",
    "text\n\n\n",
]


@pytest.mark.parametrize("text", COMPLETE)
def test_streaming_equals_parsing_for_every_split(text):
    expected = parsed(text)
    assert streamed([text]) == expected
    assert streamed(list(text)) == expected  # one character at a time
    for k in range(len(text) + 1):  # every single split point
        assert streamed([text[:k], text[k:]]) == expected, k
    for pieces in random_splits(text, random.Random(hash(text) % 1000), 200):
        assert streamed(pieces) == expected, pieces


def test_streaming_equals_parsing_on_random_texts():
    """Texts built from tag fragments, names, braces and whitespace, under random splits."""
    parts = ["<", "<tool_call>", "\n", '{"name": "', "get_weather", "f", '", "arguments": ', "{", "}", '"a": 1',
             " ", "hello", CALL_END, call_begin("f"), call_begin("get_weather"), "}}", "\n</tool_call>",
             "</tool_call>", "<tool_", " \n", "}\n", "{}", call("f", "{}"), call("get_weather", '{"a": "}"}')]
    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 14)))
        if ends_inside_call(text):
            continue
        expected = parsed(text)
        for pieces in random_splits(text, rng, 5) + [list(text)]:
            assert streamed(pieces) == expected, (text, pieces)
        checked += 1
    assert checked > 1000


def test_streaming_holds_back_only_what_is_undecided():
    streamer = ToolCallStreamer()
    assert streamer.feed("  Hello") == [ContentDelta("Hello")]  # leading whitespace is dropped
    assert streamer.feed(" world \n") == [ContentDelta(" world")]  # trailing whitespace waits
    assert streamer.feed("<tool") == []  # may become a call
    assert streamer.feed("bar> ok") == [ContentDelta(" \n<toolbar> ok")]
    assert streamer.feed("\n" + CALL_BEGIN + "get_wea") == []  # the name is not complete yet
    [start] = streamer.feed('ther", "arguments": ')
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "get_weather")
    assert streamer.feed('{"city": "Pa') == [ToolArgumentsDelta(0, '{"city":"Pa')]  # at once, compacted
    assert streamer.feed('ris"}') == [ToolArgumentsDelta(0, 'ris"')]  # "}" may start the end string
    assert streamer.feed("}") == [ToolArgumentsDelta(0, "}")]  # the second "}" does instead
    assert streamer.feed("\n</tool_call>\n") == []
    assert streamer.feed("between calls ") == [ContentDelta("between calls", "\n\n")]  # a new segment
    assert streamer.feed("\n") == []
    assert streamer.finish() == []


def test_streaming_a_call_cut_off_keeps_what_was_generated():
    text = "Sure. " + call_begin("f") + '{"city": "Pa"}\n</tool'
    assert streamed(list(text)) == ("Sure.", [("f", '{"city":"Pa"}</tool')])  # compacted as generated
    assert parsed(text) == (text, [])  # unlike the whole-text parse, which cannot have sent the call already


def test_parsing_never_raises():
    rng = random.Random(1)
    alphabet = '<>{}"\n :,_/abc' + "tool_call name arguments \u00e9\U0001F600\\"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        parse_tool_calls(text)
        streamed([text[:7], text[7:]])


# -- OpenAI chunks ---------------------------------------------------------------------------------

def test_chunk_entries():
    start, other = ToolCallStart(0, "call_a", "f"), ToolCallStart(1, "call_b", "g")
    events = [ContentDelta("Hi"), start, ToolArgumentsDelta(0, '{"a"'), ToolArgumentsDelta(0, ": 1}"), other,
              ToolArgumentsDelta(1, "{}")]
    entries = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}},
               {"index": 0, "function": {"arguments": '{"a": 1}'}},
               {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}},
               {"index": 1, "function": {"arguments": "{}"}}]
    assert chat_chunk_tool_calls(events) == entries
    assert chat_chunk_delta(events) == {"content": "Hi", "tool_calls": entries}
    fragment = {"index": 2, "function": {"arguments": "x"}}
    assert chat_chunk_delta([ToolArgumentsDelta(2, "x")]) == {"tool_calls": [fragment]}
    assert chat_chunk_delta([]) == {}
    # text after a call goes in the next chunk, so the chunks keep the order (Responses items, Anthropic blocks)
    after = [ContentDelta("Hi"), start, ToolArgumentsDelta(0, "{}"), ContentDelta("Done", "\n\n"), other]
    assert chat_chunk_deltas(after) == [
        {"content": "Hi", "tool_calls": [entries[0], {"index": 0, "function": {"arguments": "{}"}}]},
        {"content": "\n\nDone", "tool_calls": [entries[2]]}]
    assert chat_chunk_deltas([]) == []
