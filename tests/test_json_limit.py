"""Structured output at the token limit (structured/limit.py): through the real server and the official `openai`
client, every json_schema / json_object answer cut by max_tokens still parses, validates against its schema
where the limit allows the schema's shortest answer, and says finish_reason "length"; streamed text joins to the
same answer; a named tool call's arguments parse under a small max_tokens. Unit tests pin the JSON scanner and
the shortest completion against xgrammar's own matcher, and the bounded whitespace."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import xgrammar as xgr

from lmserve.config import StructuredOutputsConfig
from lmserve.sampling_params import StructuredOutputsParams
from lmserve.structured.compiler import GrammarCompiler, VocabInfo
from lmserve.structured.json_scan import JsonScan
from lmserve.structured.limit import shortest_completion
from tests.server_util import MODEL

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                 "required": ["name", "email"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
             "required": ["tags"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": ["small", "medium", "large"]}},
              "required": ["color", "size"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number", "minimum": 10},
                                                 "n": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["x", "y", "n"], "additionalProperties": False},
    "items": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["id", "label"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
    "optional": {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                                  "notes": {"type": "string"}},
                 "required": ["title", "year"], "additionalProperties": False},
    "root_array": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}},
                                              "required": ["k"], "additionalProperties": False}},
}
LIMITS = (8, 16, 32, 64)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                             "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def compiler(offline_llm):
    tok = offline_llm.tokenizer
    vocab = VocabInfo(tok.vocab_tokens(), tok.vocab_type, offline_llm.engine.model_config.vocab_size,
                      sorted(tok.eos_token_ids))
    c = GrammarCompiler(vocab, StructuredOutputsConfig())
    yield c
    c.close()


def minimum_tokens(compiler, schema) -> int:
    """Tokens of the schema's shortest answer, as the steering computes it from the grammar's start."""
    matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(json=schema)).grammar)
    return len(compiler.token_table().encode(shortest_completion(matcher, JsonScan())))


def chats(server, kws: list[dict]) -> list:
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=600) as client:
            return await asyncio.gather(*(client.chat.completions.create(model=MODEL, **kw) for kw in kws))
    return asyncio.run(run())


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a long, detailed {name} record as JSON."}]


# -- the JSON scanner and the shortest completion (no server) ----------------------------------------------------

def test_the_scanner_skips_markup_around_json():
    for text in ('[f(a={"x": 1})]', "}]} text", '{"a": 1}} [get(q="}")]', "<tool_call>\n{} </tool_call>"):
        JsonScan().feed(text).closing()  # stray closers close nothing, and never raise


@pytest.mark.parametrize("prefix, closing", [
    ('{"a": "x', '"}'), ('{"a": [1, 2', "]}"), ('{"a": tr', "ue}"), ('{"a": -', "0}"), ('{"a": 1.', "0}"),
    ('{"a": "\\', '\\"}'), ('{"a": "\\u12', '00"}'), ('{"a"', ":null}"), ('{"a": ', "null}"), ('{"a": 1, ', '"":null}'),
    ("[", "]"), ("[1, ", "null]"), ('<tool_call>\n{"name": "f", "arguments": {"x": "y', '"}}'), ('{"a": {}}', ""),
])
def test_the_scanner_closes_every_json_prefix(prefix, closing):
    assert JsonScan().feed(prefix).closing() == closing
    json.loads(prefix.split("\n")[-1] + closing)


def test_shortest_completion_follows_the_schema_from_any_state(compiler):
    for name, schema in SCHEMAS.items():
        matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(json=schema)).grammar)
        text = shortest_completion(matcher, JsonScan())
        jsonschema.validate(json.loads(text), schema)
        half = text[:len(text) // 2]
        assert matcher.accept_string(half)
        rest = shortest_completion(matcher, JsonScan().feed(half))
        jsonschema.validate(json.loads(half + rest), schema)
        assert not matcher.is_completed()  # the search ran on a fork: the matcher is where it was


def test_json_whitespace_is_bounded(compiler):
    """No run of spaces or newlines a sampling model could spend its budget on: one space after ',' and ':'."""
    for spec in (StructuredOutputsParams(json=SCHEMAS["person"]), StructuredOutputsParams(json_object=True)):
        matcher = xgr.GrammarMatcher(compiler.compile(spec).grammar)
        assert not matcher.accept_string(" ") and not matcher.accept_string("\n")
        assert matcher.accept_string('{"name": ')
        assert not matcher.accept_string(" ") and not matcher.accept_string("\n")


# -- through the server ------------------------------------------------------------------------------------------

def test_every_schema_at_every_limit_parses_and_validates_where_it_fits(server, compiler):
    cases = [(name, limit, seed) for name in SCHEMAS for limit in LIMITS for seed in range(2)]
    replies = chats(server, [dict(messages=ask(name), max_tokens=limit, temperature=0.8, seed=seed,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": name, "schema": SCHEMAS[name], "strict": True}})
                             for name, limit, seed in cases])
    minimums = {name: minimum_tokens(compiler, schema) for name, schema in SCHEMAS.items()}
    print("shortest valid answer (tokens):", minimums)
    validated, invalid = 0, []
    for (name, limit, seed), r in zip(cases, replies):
        c = r.choices[0]
        value = json.loads(c.message.content)  # always
        assert r.usage.completion_tokens <= limit
        if c.finish_reason != "length":
            assert c.finish_reason == "stop" and r.usage.completion_tokens < limit
        if limit >= minimums[name]:
            errors = [e.message for e in jsonschema.Draft202012Validator(SCHEMAS[name]).iter_errors(value)]
            invalid += [(name, limit, seed, c.message.content, errors)] if errors else []
            validated += 1
    assert not invalid, invalid
    assert validated >= len(cases) // 2  # the limits reach past most schemas' minimum
    assert sum(r.choices[0].finish_reason == "length" for r in replies) >= len(cases) // 2


def test_the_limit_reports_length_and_a_stream_joins_to_the_same_text(client):
    kw = dict(model=MODEL, messages=ask("nested"), max_tokens=16, temperature=0.8, seed=3,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}})
    whole = client.chat.completions.create(**kw).choices[0]
    parts, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert whole.finish_reason == finish == "length"
    assert "".join(parts) == whole.message.content
    json.loads(whole.message.content)


def test_json_object_at_small_limits(client):
    for limit in (1, 3, 8, 16, 32):
        r = client.chat.completions.create(model=MODEL, messages=ask("inventory"), max_tokens=limit, temperature=0.8,
                                           seed=limit, response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content


def test_named_tool_call_arguments_parse_under_a_small_limit(client):
    params = TOOL["function"]["parameters"]
    bound = []
    for limit in (37, 40, 48, 64):  # the call's shortest form (hermes: tags, name, "city":"", "unit") is 36 tokens
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in a very long-named town, in detail?"}],
            tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=limit, temperature=0.8, seed=limit)
        c = r.choices[0]
        assert c.message.tool_calls, (limit, c)
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), params)
        # a named choice makes one call and ends (tool_calls) where it fits; where the limit binds, the steered
        # close still parses and the finish says length
        bound.append(c.finish_reason == "length")
        assert (c.finish_reason == "length" and r.usage.completion_tokens <= limit) or (
            c.finish_reason == "tool_calls" and r.usage.completion_tokens < limit), (limit, c.finish_reason, r.usage)
    assert bound[0], "the smallest limit must bind, or this test checks no steering"


def test_ollama_format_at_a_small_num_predict(server):
    import ollama  # noqa: PLC0415

    client = ollama.Client(host=server.url)
    r = client.chat(model=MODEL, messages=ask("person"), format=SCHEMAS["person"],
                    options={"num_predict": 12, "temperature": 0.8, "seed": 1})
    assert r.done_reason == "length"
    jsonschema.validate(json.loads(r.message.content), SCHEMAS["person"])  # 12 >= its shortest answer (10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
