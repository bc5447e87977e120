"""Output parsers (parsers/): reasoning split, every tool-call format parsed whole and streamed (equal on random
splits), calls written for a history and read back, the default format from a chat template, the reasoning gate
that holds a grammar back, and each format's grammar generating text its parser reads (the embedded model)."""

from __future__ import annotations

import json
import random

import pytest

from lmserve.parsers.events import ContentDelta, ReasoningDelta, ToolArgumentsDelta, ToolCallStart
from lmserve.parsers.output import OutputParser
from lmserve.parsers.reasoning import REASONING_PARSERS, ReasoningStreamer, parser_for
from lmserve.parsers.tool_calls import ToolCallStreamer, parse_tool_calls
from lmserve.parsers.tool_formats import TOOL_FORMATS, detect_format
from lmserve.structured.grammar import ReasoningGate
from tests.test_tools import random_splits

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}, "required": ["city"]}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"]}


# -- reasoning ----------------------------------------------------------------------------------------------------

REASONING_CASES = [  # (parser, text, reasoning, content)
    (R1, "plan it</think>The answer", "plan it", "The answer"),
    (R1, "<think>plan</think>\n\nok", "plan", "\n\nok"),  # a leading <think> written by the model is dropped
    (R1, "still thinking", "still thinking", None),  # no end tag: all reasoning (cut off, or never ended)
    (R1, "</think>only answer", None, "only answer"),
    (R1, "a <think> b</think>c</think>d", "a <think> b", "c</think>d"),  # later tags are text
    (R1, "", None, None),
    (QWEN3, "<think>plan</think>answer", "plan", "answer"),
    (QWEN3, "no thinking here", None, "no thinking here"),
    (QWEN3, "lead <think>plan", "plan", "lead "),  # cut off inside the reasoning
    (QWEN3, "a </think> b", None, "a </think> b"),  # an end tag without a start is text
    (QWEN3, "<think></think>x<think>y", None, "x<think>y"),
]


@pytest.mark.parametrize("parser,text,reasoning,content", REASONING_CASES)
def test_reasoning_split(parser, text, reasoning, content):
    got = parser.split(text)
    assert (got.reasoning, got.content) == (reasoning, content)


def streamed_reasoning(parser, pieces: list[str]) -> tuple[str | None, str | None]:
    streamer = ReasoningStreamer(parser)
    events = [e for p in pieces for e in streamer.feed(p)] + streamer.finish()
    assert all(e.text for e in events)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning or None, content or None


def test_reasoning_streaming_equals_split_on_random_splits():
    parts = ["<think>", "</think>", "<", "</", "<th", "think>", "plan", " ", "\n", "answer", ">", "/"]
    rng = random.Random(0)
    for parser in (R1, QWEN3):
        for _ in range(600):
            text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
            whole = parser.split(text)
            for pieces in random_splits(text, rng, 4) + [list(text)]:
                assert streamed_reasoning(parser, pieces) == (whole.reasoning, whole.content), (parser.name, pieces)


def test_reasoning_holds_back_only_a_possible_tag():
    streamer = ReasoningStreamer(R1)
    assert streamer.feed("<th") == []  # may still be the model's own <think>
    assert streamer.feed("ink>plan </th") == [ReasoningDelta("plan ")]
    assert streamer.feed("ink>\nAnswer") == [ContentDelta("\nAnswer")]
    assert streamer.finish() == []


def test_thinking_off_means_no_reasoning_parser():
    assert parser_for(None) is None and parser_for("qwen3") is QWEN3
    assert parser_for("qwen3", {"enable_thinking": False}) is None
    assert parser_for("deepseek_r1", {"thinking": False}) is None
    assert parser_for("deepseek_r1", {"enable_thinking": True}) is R1


# -- tool-call formats: whole texts -------------------------------------------------------------------------------

FORMAT_CASES = {  # format -> [(text, content, [(name, arguments)])]
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city":"Paris"}')]),
        ('<|python_tag|>{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", '{"a":[1,2]}')]),
        ('Sure. {"name":"f","parameters":{"s":"}{"}}; {"name": "g", "parameters": {}}', "Sure.",
         [("f", '{"s":"}{"}'), ("g", "{}")]),
        ('{"name": "f", "parameters": {"a": 1}', None, [("f", '{"a":1}')]),  # the closing brace forgiven at the end
        ('{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),  # cut off
        ('{"name": "has space", "parameters": {}}', '{"name": "has space", "parameters": {}}', []),
        ("just text {not a call}", "just text {not a call}", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
         [("get_weather", '{"city":"Paris"}')]),
        ('Hi [TOOL_CALLS] [ {"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}} ]', "Hi",
         [("f", '{"a":1}'), ("g", "{}")]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}][TOOL_CALLS][{"name": "g", "arguments": {"b": "x"}}]', None,
         [("f", "{}"), ("g", '{"b":"x"}')]),
        ('[TOOL_CALLS][{"arguments": {}, "name": "f"}]', '[TOOL_CALLS][{"arguments": {}, "name": "f"}]', []),
        ('[1, {"name": "f", "arguments": {}}]', '[1, {"name": "f", "arguments": {}}]', []),  # no marker: text
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3, metric=True)]', None,
         [("get_weather", '{"city":"Paris","days":3,"metric":true}')]),
        ("[f(a='x', b=[1, (2, 3)], c={'k': None}), g()]", None,
         [("f", '{"a":"x","b":[1,[2,3]],"c":{"k":null}}'), ("g", "{}")]),
        ("Calling: [f(a=-1.5, b=null, c=true)]", "Calling:", [("f", '{"a":-1.5,"b":null,"c":true}')]),
        ("[f(a=x + 1, b='s, )')]", None, [("f", '{"a":"x + 1","b":"s, )"}')]),  # not a literal: its source text
        ("[f(1)]", "1)]", [("f", "{}")]),  # a positional argument ends the call; the rest is text after it
        ("[f(a=1)]\nIt is sunny.", "It is sunny.", [("f", '{"a":1}')]),  # the list's "]" is not text
        ("[f(a=1", "[f(a=1", []),
        ("a list [1, 2] and [x y]", "a list [1, 2] and [x y]", []),
    ],
    "qwen3_xml": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n<parameter=metric>\nfalse\n</parameter>\n</function>\n</tool_call>", None,
         [("get_weather", '{"city":"Paris","days":3,"metric":false}')]),
        ("Let me look.\n<tool_call><function=get_weather><parameter=city>New\nYork</parameter><parameter=days>"
         "soon</parameter><parameter=other>[1]</parameter></function></tool_call>", "Let me look.",
         [("get_weather", '{"city":"New\\nYork","days":"soon","other":"[1]"}')]),  # types from the schema only
        ("<tool_call>\n<function=f>\n</function>\n</tool_call>\n<tool_call><function=g><parameter=x>1</parameter>"
         "</function></tool_call>", None, [("f", "{}"), ("g", '{"x":"1"}')]),
        ("<tool_call>\n<function=f>\n<parameter=a>\n1", "<tool_call>\n<function=f>\n<parameter=a>\n1", []),
    ],
}
CASES = [(fmt, *case) for fmt, cases in FORMAT_CASES.items() for case in cases]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse_each_format(fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, TOOL_FORMATS[fmt], SCHEMAS)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls


def streamed_calls(fmt: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], bool]:
    """(content, calls, ended inside a call) from a streamer fed `pieces`; checks the events' own invariants."""
    streamer = ToolCallStreamer(TOOL_FORMATS[fmt], SCHEMAS)
    events = [e for p in pieces for e in streamer.feed(p)] + streamer.finish()
    content, calls = "", []
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text and (e.sep == "" or (calls and content))  # a separator only before a later segment
            content += e.joined
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls)
            calls.append([e.name, ""])
        else:
            assert isinstance(e, ToolArgumentsDelta) and e.text and e.index == len(calls) - 1
            calls[-1][1] += e.text
    return content or None, [tuple(c) for c in calls], streamer.in_call


FRAGMENTS = {
    "hermes": ["<tool_call>\n", '{"name": "', "f", "get_weather", '", "arguments": ', "{", "}", '"a": 1', "}\n</tool_call>",
               "</tool_call>", " ", "\n", "text", "<"],
    "llama3_json": ['{"name": "', '{"name":"', "f", '", "parameters": ', '", "arguments":', "{", "}", '"a": [1, "}"]',
                    "; ", "<|python_tag|>", " ", "text", '"', "\\", ","],
    "mistral": ["[TOOL_CALLS]", "[", "]", '{"name": "', "f", '", "arguments": ', "{}", "{", "}", ", ", '"b": "]"',
                " ", "text"],
    "pythonic": ["[", "f", "get_weather", "(", ")", "]", "a=", "city=", "'x'", '"y, )"', "1", ", ", "[1, 2]", " ",
                 "text", "True", "(", "{'k': 2}"],
    "qwen3_xml": ["<tool_call>", "<function=", "f", ">", "<parameter=", "city", "days", "3", "Paris", "</parameter>",
                  "</function>", "</tool_call>", "\n", " ", "text", "<"],
}


@pytest.mark.parametrize("fmt", sorted(FRAGMENTS))
def test_streaming_equals_parsing_for_every_format_on_random_splits(fmt):
    """Texts built from each format's fragments: wherever no call is cut off, streaming on random splits (and a
    character at a time) gives exactly what the whole-text parse gives."""
    rng = random.Random(fmt)
    checked = 0
    texts = [t for f, t, _, _ in CASES if f == fmt]
    texts += ["".join(rng.choice(FRAGMENTS[fmt]) for _ in range(rng.randint(0, 16))) for _ in range(1000)]
    for text in texts:
        content, calls = parse_tool_calls(text, TOOL_FORMATS[fmt], SCHEMAS)
        expected = (content, [(c.name, c.arguments) for c in calls])
        got = [streamed_calls(fmt, pieces) for pieces in random_splits(text, rng, 4) + [list(text), [text]]]
        if got[-1][2]:  # a call cut off: the stream has sent it, the whole-text parse drops it
            assert all(len(g[1]) == len(expected[1]) + 1 for g in got), text
            continue
        for g in got:
            assert g[:2] == expected, (text, g)
        checked += 1
    assert checked > 400


def test_arguments_stream_as_they_are_decided():
    streamer = ToolCallStreamer(TOOL_FORMATS["pythonic"], SCHEMAS)
    assert streamer.feed("Ok [get_wea") == [ContentDelta("Ok")]
    start, args = streamer.feed('ther(city="Pa')
    assert isinstance(start, ToolCallStart) and args == ToolArgumentsDelta(0, "{")
    assert streamer.feed('ris", ') == [ToolArgumentsDelta(0, '"city":"Paris"')]
    assert streamer.feed("days=2)") == [ToolArgumentsDelta(0, ',"days":2}')]
    assert streamer.feed("]") == [] and streamer.finish() == []


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_a_written_call_reads_back(fmt):
    """The history text of past calls (a template without tools support) parses back to the same calls."""
    f = TOOL_FORMATS[fmt]
    text = "\n".join([f.format_call("get_weather", '{"city": "Paris", "days": 3}'), f.format_call("noop", "")])
    content, calls = parse_tool_calls(text, f, SCHEMAS)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                 ("noop", {})]


def test_output_parser_reads_calls_in_the_answer_only():
    parser = OutputParser(R1, TOOL_FORMATS["hermes"])
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text = f"I will call {call} now</think>Done. {call}"
    whole = parser.parse(text)
    assert whole.reasoning == f"I will call {call} now" and whole.content == "Done."
    assert [(c.name, c.arguments) for c in whole.calls] == [("f", '{"a":1}')]
    for pieces in random_splits(text, random.Random(3), 50):
        streamer = parser.streamer()
        events = [e for p in pieces for e in streamer.feed(p)] + streamer.finish()
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == whole.reasoning
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == whole.content
        assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["f"] and streamer.num_calls == 1


def test_default_format_from_the_chat_template(smol_path):
    from lmserve.tokenizer import Tokenizer

    assert detect_format(Tokenizer.from_gguf(smol_path).chat_template) == "hermes"  # SmolLM2: today's format
    assert detect_format(None) == "hermes"
    assert detect_format("{{ '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}") == "hermes"
    assert detect_format("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>") == "qwen3_xml"
    assert detect_format("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert detect_format('{{- "<|python_tag|>" }}{"name": ..., "parameters": ...}') == "llama3_json"
    assert detect_format("[func_name1(params_name1=params_value1)]") == "pythonic"


# -- the reasoning gate (structured/grammar.py) --------------------------------------------------------------------

def test_reasoning_gate_opens_after_the_end_tokens():
    gate = ReasoningGate((7, 8))
    states = []
    for t in (1, 7, 2, 7, 8, 9):
        gate = gate.after(t) if gate is not None else None
        states.append(gate is None)
    assert states == [False, False, False, False, True, True]
    assert ReasoningGate.for_prompt([1, 5, 2, 7, 8, 3], start=[5], end=[7, 8]) is None  # the prompt closed it
    assert ReasoningGate.for_prompt([1, 7, 8, 5, 2], start=[5], end=[7, 8]) == ReasoningGate((7, 8))
    assert ReasoningGate.for_prompt([1, 2], start=[5], end=[7, 8]) == ReasoningGate((7, 8))


# -- each format's grammar (parsers/tool_grammar.py) on the embedded model -----------------------------------------

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_each_format_grammar_generates_what_its_parser_reads(offline_llm):
    """tool_choice required or named (alternating) in every format: the constrained text is that family's calls,
    read back whole and streamed, arguments valid for the tool's schema."""
    import jsonschema

    from lmserve import SamplingParams
    from lmserve.parsers.tool_grammar import tool_call_tag
    from lmserve.server.api.tools import prepare_chat

    tools, formats = [WEATHER, TIME], sorted(TOOL_FORMATS.items())
    choices = ["required" if i % 2 == 0 else NAMED for i in range(len(formats))]
    prompts, params = [], []
    for (name, fmt), choice in zip(formats, choices):
        messages, kwargs = prepare_chat([{"role": "user", "content": "Weather in Paris?"}], tools, False, fmt)
        prompts.append(offline_llm.tokenizer.encode_chat(messages, **kwargs))
        params.append(SamplingParams(temperature=0, max_tokens=80, skip_special_tokens=not fmt.keeps_special_tokens,
                                     structured_outputs={"structural_tag": tool_call_tag(tools, choice, False, name)}))
    outs = offline_llm.generate(prompts, params, use_tqdm=False)
    for (name, fmt), choice, out in zip(formats, choices, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (name, text)  # the grammar ended after its one call
        assert "<|im_end|>" not in text  # mistral keeps special tokens: the EOS that ended it is still not text
        content, calls = parse_tool_calls(text, fmt, SCHEMAS)
        assert content is None and len(calls) == 1, (name, text)
        assert calls[0].name in ("get_weather", "get_time") and (choice == "required" or calls[0].name == "get_weather")
        schema = SCHEMAS.get(calls[0].name, TIME["function"]["parameters"])
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        for pieces in random_splits(text, random.Random(name), 20):
            assert streamed_calls(name, pieces)[:2] == (None, [(calls[0].name, calls[0].arguments)])


def test_a_gated_grammar_masks_nothing_until_the_reasoning_ends(offline_llm):
    """Rows before the end tag's tokens allow every token and the matcher sees none of them; drafts that cross the
    end get the grammar's rows after it; the matcher is left where it was."""
    import torch

    from lmserve.config import StructuredOutputsConfig
    from lmserve.sampling_params import StructuredOutputsParams
    from lmserve.structured.compiler import GrammarCompiler, VocabInfo
    from lmserve.structured.grammar import Grammar, fill_bitmask
    from lmserve.structured.mask import reference_allowed

    tok = offline_llm.tokenizer
    vocab = VocabInfo(tok.vocab_tokens(), tok.vocab_type, offline_llm.engine.model_config.vocab_size,
                      sorted(tok.eos_token_ids))
    compiler = GrammarCompiler(vocab, StructuredOutputsConfig())
    try:
        compiled = compiler.compile(StructuredOutputsParams(choice=["yes"])).grammar
    finally:
        compiler.close()
    end = tok.encode("</think>", add_special_tokens=False)
    yes = tok.encode("yes", add_special_tokens=False)
    thought = tok.encode("hmm no", add_special_tokens=False)
    g = Grammar(compiled, tok.eos_token_ids, ReasoningGate(tuple(end)))
    assert len(end) > 1 and g.valid_prefix(thought + end + yes) == len(thought + end + yes)
    drafts = [*end, *yes]
    allowed = reference_allowed(torch.from_numpy(fill_bitmask([(g, drafts, None, None)])), vocab.vocab_size)
    assert [int(allowed[r].sum()) for r in range(len(end))] == [vocab.vocab_size] * len(end)  # still thinking
    assert allowed[len(end)][yes[0]] and int(allowed[len(end)].sum()) < 10  # the grammar's first row
    assert not g.terminated and all(g.accept(t) for t in thought + end)  # the matcher saw nothing so far
    assert g.gate is None and not g.accept(thought[0])  # now the grammar holds: "hmm" is refused
    assert all(g.accept(t) for t in yes)
