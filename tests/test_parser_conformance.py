"""Tool-call parser conformance, per family: model outputs (text before a call, one call, two calls, text after,
a call inside the reasoning that must not surface, unicode and escaped quotes in arguments) read whole give the
expected calls and content, and streamed on 20 splits at token boundaries of the embedded SmolLM2 tokenizer
(plus a character at a time) the deltas join to exactly the whole answer's calls and content.

Text before, between and after calls is content (tool_calls.py): each segment stripped, a whitespace-only one
dropped, the segments joined by SEGMENT_SEP; `parts` keeps them in order with the calls (what Anthropic's blocks
and the Responses API's items follow), and the streamed events give the same segments in the same order."""

from __future__ import annotations

import json
import random

import pytest

from lmserve.parsers.events import ContentDelta, ReasoningDelta, ToolArgumentsDelta, ToolCallStart
from lmserve.parsers.output import OutputParser
from lmserve.parsers.reasoning import REASONING_PARSERS
from lmserve.parsers.tool_calls import SEGMENT_SEP
from lmserve.parsers.tool_formats import TOOL_FORMATS, detect_format

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
           "search": {"type": "object", "properties": {"q": {"type": "string"}}}}
PARIS = {"city": "Paris", "days": 2}
TRICKY = {"q": 'São "Paulo" 東京 ☃ \\ end', "n": [1, {"k": None}]}  # unicode, escaped quotes, a backslash


def _json(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def _py(args: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


# family -> (how one call is written, how calls are joined, how the family's reasoning wraps text)
WRITE = {
    "hermes": (lambda n, a: f'<tool_call>\n{{"name": "{n}", "arguments": {_json(a)}}}\n</tool_call>', "\n"),
    "llama3_json": (lambda n, a: f'<|python_tag|>{{"name": "{n}", "parameters": {_json(a)}}}', "; "),
    "mistral": (lambda n, a: f'[TOOL_CALLS][{{"name": "{n}", "arguments": {_json(a)}}}]', ""),
    "mistral_v11": (lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{_json(a)}", ""),
    "phi4_mini": (lambda n, a: f'<|tool_call|>[{{"name": "{n}", "arguments": {_json(a)}}}]<|/tool_call|>', "\n"),
    "gemma3": (lambda n, a: f"```tool_code\n{n}({_py(a)})\n```", "\n"),
    "gemma3_list": (lambda n, a: f"[{n}({_py(a)})]", "\n"),
    "pythonic": (lambda n, a: f"[{n}({_py(a)})]", "\n"),
    "qwen3_xml": (lambda n, a: "<tool_call>\n<function=" + n + ">\n" + "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>", "\n"),
    "harmony": (lambda n, a: f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{_json(a)}<|call|>",
                "<|start|>assistant"),
}
THINK = {"harmony": ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"), None: ("<think>", "</think>")}


def _joined(*segments: str) -> str:
    return SEGMENT_SEP.join(segments)


def _cases(family: str) -> list[tuple[str, str, str | None, list[tuple[str, dict]]]]:
    """(case, text, content, calls) for one family."""
    call, sep = WRITE[family]
    start, end = THINK.get(family, THINK[None])
    tricky = TRICKY if family != "qwen3_xml" else {"q": TRICKY["q"]}  # xml values are strings unless typed
    one, two = call("get_weather", PARIS), call("get_weather", PARIS) + sep + call("search", tricky)
    return [
        ("text before", "Let me check that.\n" + one, "Let me check that.", [("get_weather", PARIS)]),
        ("one call", one, None, [("get_weather", PARIS)]),
        ("two calls", two, None, [("get_weather", PARIS), ("search", tricky)]),
        ("text after", "Checking. " + one + "\nThat is all.", "Checking." + SEGMENT_SEP + "That is all.",
         [("get_weather", PARIS)]),
        ("only text after", one + "\nIt is sunny in Paris.\n", "It is sunny in Paris.", [("get_weather", PARIS)]),
        ("text between and after", "First. " + call("get_weather", PARIS) + "\nThen « search ».\n"
         + call("search", tricky) + "\n\nDone, 20°C.", _joined("First.", "Then « search ».", "Done, 20°C."),
         [("get_weather", PARIS), ("search", tricky)]),
        ("whitespace after", one + "\n \n", None, [("get_weather", PARIS)]),
        ("call in reasoning", start + "maybe " + call("search", {"q": "x"}) + " no" + end + "Sunny, 20°C.",
         "Sunny, 20°C.", []),
        ("reasoning then call", start + "I need the weather." + end + one, None, [("get_weather", PARIS)]),
        ("unicode and quotes", "Voilà « ça » \"ok\"\n" + call("search", tricky), 'Voilà « ça » "ok"',
         [("search", tricky)]),
    ]


FAMILY_FORMAT = {"mistral_v11": "mistral", "gemma3_list": "gemma3"}
CASES = [pytest.param(fam, *case[1:], id=f"{fam}-{case[0]}") for fam in WRITE for case in _cases(fam)]


def _parser(family: str) -> OutputParser:
    reasoning = REASONING_PARSERS["gpt_oss" if family == "harmony" else "qwen3"]
    return OutputParser(reasoning, TOOL_FORMATS[FAMILY_FORMAT.get(family, family)], SCHEMAS)


@pytest.fixture(scope="module")
def tokenizer(smol_path):
    from lmserve.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smol_path)


def token_boundaries(tok, text: str) -> list[int]:
    """Character offsets in `text` where one of the SmolLM2 tokenizer's tokens ends."""
    ids = tok.encode(text, add_special_tokens=False)
    out = []
    for i in range(1, len(ids)):
        prefix = tok.decode(ids[:i], skip_special_tokens=False)
        if text.startswith(prefix) and 0 < len(prefix) < len(text) and (not out or len(prefix) > out[-1]):
            out.append(len(prefix))
    return out


def token_splits(tok, text: str, rng: random.Random, count: int) -> list[list[str]]:
    """`count` splits of `text` into stream pieces, each cut at a token boundary (one in three kept, on average)."""
    bounds = token_boundaries(tok, text)
    assert len(bounds) > 5, text  # the tokenizer really did cut the text
    splits = [[text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]]  # one token a delta
    for _ in range(count - 1):
        cuts = [b for b in bounds if rng.random() < 1 / 3]
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return splits


def streamed(parser: OutputParser, pieces: list[str]) -> tuple:
    """(reasoning, content, calls, parts) joined from the events of one streamed reply, checking the events' order;
    parts: the content segments and (name, arguments) calls in the order the events gave them."""
    s = parser.streamer()
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    reasoning, content, calls, parts = "", "", [], []
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning += e.text
        elif isinstance(e, ContentDelta):
            assert e.text
            content += e.joined
            if parts and isinstance(parts[-1], str):
                assert not e.sep  # a segment goes on: no separator inside it
                parts[-1] += e.text
            else:  # a new segment: stripped, with the separator when content came before
                assert e.text == e.text.strip() and e.sep == (SEGMENT_SEP if len(content) > len(e.joined) else "")
                parts.append(e.text)
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls) and e.id.startswith("call_")
            calls.append([e.name, ""])
            parts.append(calls[-1])
        else:
            assert isinstance(e, ToolArgumentsDelta) and e.text and e.index == len(calls) - 1
            calls[-1][1] += e.text
    return (reasoning or None, content or None, [tuple(c) for c in calls],
            [p if isinstance(p, str) else tuple(p) for p in parts])


def _whole(parsed) -> tuple:
    """The same tuple from a whole answer's Parsed."""
    return (parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.calls],
            [p if isinstance(p, str) else (p.name, p.arguments) for p in parsed.parts])


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_each_family_streamed_on_token_splits_equals_the_whole_answer(tokenizer, family, text, content, calls):
    parser = _parser(family)
    whole = parser.parse(text)
    assert whole.content == content, text
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls, text
    assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False, separators=(",", ":"))
               for c in whole.calls)  # compact JSON, unicode as written
    if "maybe" in text:  # the call inside the reasoning stayed reasoning
        assert "search" in whole.reasoning and not whole.calls
    segments = [p for p in whole.parts if isinstance(p, str)]
    assert SEGMENT_SEP.join(segments) == (content or "") and all(p == p.strip() and p for p in segments)
    if content and whole.calls and text.rstrip().endswith(content.split(SEGMENT_SEP)[-1]):
        # the text after the last call is a part after it (a block / an item of its own)
        assert isinstance(whole.parts[-1], str) and not isinstance(whole.parts[-2], str)
    expected = _whole(whole)
    rng = random.Random(f"{family}:{text}")
    for pieces in token_splits(tokenizer, text, rng, 20) + [list(text)]:
        assert streamed(parser, pieces) == expected, pieces


@pytest.mark.parametrize("family", sorted(WRITE))
def test_each_family_written_call_reads_back(family):
    """The format's own history text (what the server writes for a past call) reads back as the same call."""
    fmt = TOOL_FORMATS[FAMILY_FORMAT.get(family, family)]
    args = TRICKY if family != "qwen3_xml" else {"q": TRICKY["q"]}  # xml values are strings unless typed
    parsed = OutputParser(None, fmt, SCHEMAS).parse(fmt.format_call("search", json.dumps(args)))
    assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("search", args)]


HARMONY_TURNS = [  # (gpt-oss output after the prompt's "<|start|>assistant", reasoning, content, calls)
    ("<|channel|>analysis<|message|>Need weather; call to=functions.search<|message|>{}<|call|> later.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city":"Paris","days":2}<|call|>',
     "Need weather; call to=functions.search<|message|>{}<|call|> later.", "Checking the forecast.",
     [("get_weather", PARIS)]),
    ("<|start|>assistant to=functions.search<|channel|>commentary json<|message|>" + _json(TRICKY) + "<|call|>",
     None, None, [("search", TRICKY)]),  # the recipient before the channel, as harmony also allows
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is « sunny »."
     "<|return|>",
     "Easy.", "It is « sunny ».", []),
]


@pytest.mark.parametrize("text,reasoning,content,calls", HARMONY_TURNS)
def test_harmony_channels(tokenizer, text, reasoning, content, calls):
    """gpt-oss: the analysis channel is reasoning (a call written there is not one), commentary messages to
    functions.NAME are calls, the final channel (or a commentary preamble) is content without its framing."""
    parser = _parser("harmony")
    whole = parser.parse(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    expected = _whole(whole)
    for pieces in token_splits(tokenizer, text, random.Random(text), 20) + [list(text)]:
        assert streamed(parser, pieces) == expected, pieces


TEMPLATES = {  # a fragment of each family's published chat template -> the parser it gets
    "hermes": "{{- '<tool_call>\\n' }}{{- tool_call | tojson }}{{- '\\n</tool_call>' }}",  # Qwen2.5/3, SmolLM3
    "llama3_json": '{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}',  # Llama 3.1/3.2
    "mistral": "{{- '[TOOL_CALLS]' + tool_call.name + '[ARGS]' + tool_call.arguments|tojson }}",
    "phi4_mini": "{% if message['tools'] %}{{ '<|tool|>' + message['tools'] + '<|/tool|>' }}{% endif %}",
    "gemma3": "{{ '<start_of_turn>' + role + '\\n' }}",
    "harmony": "{{- '<|start|>assistant<|channel|>commentary to=functions.' + name + '<|message|>' }}",
    "qwen3_xml": "<tool_call>\\n<function={{ name }}>\\n<parameter={{ k }}>",
    "pythonic": "[func_name1(params_name1=params_value1, params_name2=params_value2...)]",
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_each_family_is_picked_from_its_template(family):
    assert detect_format(TEMPLATES[family]) == family


# -- route level: the embedded model served with a Llama-3-style tool template ------------------------------------

LLAMA3_TOOL_TEMPLATE = """{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>

Given the following functions, respond with a JSON for a function call with its proper arguments that best \
answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. \
Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}<|eot_id|>{%- endif %}{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


@pytest.fixture(scope="module")
def llama3_templated_gguf(smol_path, tmp_path_factory):
    """The embedded SmolLM2 GGUF with its chat template replaced by a Llama-3-style tool template (gguf's own
    metadata tool: the tensors are copied as they are)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("llama3tpl") / "smollm2-llama3-tools.gguf"
    template = out.with_suffix(".jinja")
    template.write_text(LLAMA3_TOOL_TEMPLATE)
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file", str(template),
                    str(smol_path), str(out)], check=True, capture_output=True, timeout=300)
    return out


def test_a_llama3_template_gets_the_llama3_json_parser_on_the_route(llama3_templated_gguf):
    """Served with a Llama-3-style template, the server picks llama3_json (found from the template's markers):
    a named tool_choice makes the grammar write {"name": ..., "parameters": ...}, seen in the reply's token
    logprobs, and the route reads it back as the call, whole and streamed; --tool-call-parser hermes overrides it."""
    from openai import OpenAI

    from lmserve.tokenizer import Tokenizer
    from tests.server_util import running_server

    assert detect_format(Tokenizer.from_gguf(llama3_templated_gguf).chat_template) == "llama3_json"
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    ask = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
               tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    for extra, begins in (((), '{"name": "get_weather", "parameters": '),
                          (("--tool-call-parser", "hermes"), '<tool_call>\n{"name": "get_weather", "arguments": ')):
        with running_server("--model", str(llama3_templated_gguf), "--served-model-name", "m", *extra) as s:
            client = OpenAI(base_url=s.url + "/v1", api_key="unused")
            reply = client.chat.completions.create(**ask, logprobs=True)
            choice = reply.choices[0]
            raw = "".join(t.token for t in choice.logprobs.content)
            assert raw.startswith(begins), raw
            assert choice.message.content is None and len(choice.message.tool_calls) == 1, raw
            call = choice.message.tool_calls[0].function
            assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
            chunks = list(client.chat.completions.create(**ask, stream=True))
            deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
            assert "".join(d.function.arguments or "" for d in deltas) == call.arguments
