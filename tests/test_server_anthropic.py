"""Anthropic's Messages API through the official `anthropic` client, against a real `lmserve serve` with an API key.

One server for the module (the key is required, so every call also checks x-api-key auth); greedy sampling, so
streamed and whole answers can be compared exactly.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server_util import MODEL, running_server

KEY = "anthropic-test-key"
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the API takes temperature; this SDK version sends it only as an extra


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", KEY, headers={"Authorization": f"Bearer {KEY}"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_create(client):
    m = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK,
                               system="Answer in one short sentence.", metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.output_tokens <= 24 and m.usage.input_tokens > 10
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 24


def test_stream_equals_create(client):
    kw = dict(model=MODEL, max_tokens=32, extra_body=GREEDY, messages=ASK,
              system=[{"type": "text", "text": "Be brief."}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens  # Anthropic's split of the prompt
    assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens + final.usage.cache_read_input_tokens) \
        == (whole.stop_reason, whole.usage.output_tokens, prompt)
    assert final.usage.cache_read_input_tokens > 0 and final.usage.cache_creation_input_tokens == 0  # whole's prefix


def test_stream_events_in_order(server):
    """The raw events: message_start, ping, one text block's start / deltas / stop, message_delta, message_stop."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": ASK, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names  # each event's name is its data's type
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 4


def test_tool_use_round_trip(client):
    """tool_choice "tool" forces a schema-valid tool_use block; its tool_result sent back gets a text answer."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=MODEL, max_tokens=80, extra_body=GREEDY, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [*ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": '{"temperature_c": 21, "sky": "sunny"}'}]}]
    answer = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()


def test_tool_use_streamed_equals_whole(client):
    """input_json_delta fragments join to the same input the whole answer has (tool_choice any; one call, so that
    none is cut off by max_tokens, where a stream cannot take back the arguments it has sent)."""
    kw = dict(model=MODEL, max_tokens=80, extra_body=GREEDY, tools=[WEATHER],
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Weather in Rome?"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in whole.content]
    assert strip == [{k: v for k, v in b.model_dump().items() if k != "id"} for b in final.content]
    assert whole.content[-1].type == "tool_use" and final.stop_reason == whole.stop_reason


def test_count_tokens_equals_usage(client):
    kw = dict(model=MODEL, messages=ASK, system="Be brief.", tools=[WEATHER])
    count = client.messages.count_tokens(**kw)
    m = client.messages.create(**kw, max_tokens=2, extra_body=GREEDY)
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 50  # with the tool preamble


def test_stop_sequences(client):
    kw = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK)
    text = client.messages.create(**kw).content[0].text
    stop = text.strip().split()[1]  # the second word of the greedy answer
    m = client.messages.create(**kw, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text.startswith(m.content[0].text) and stop not in m.content[0].text


def error_of(r: httpx.Response) -> str:
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"], body
    return body["error"]["type"]


def test_error_shapes(server, client):
    url, auth = server.url + "/v1/messages", {"x-api-key": KEY}
    r = httpx.post(url, json={"model": MODEL, "messages": ASK}, headers=auth)  # no max_tokens
    assert r.status_code == 400 and error_of(r) == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 1.5})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-no-such-model", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.get(url, headers=auth)  # FastAPI's own 405 on this path: Anthropic's shape too
    assert r.status_code == 405 and error_of(r) == "invalid_request_error"
    refused = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                           "data": "AAAA"}}]},
               {"role": "assistant", "content": "Paris is"}]  # a final assistant turn (prefill)
    for messages in ([refused[0]], [*ASK, refused[1]]):
        r = httpx.post(url + "/count_tokens", json={"model": MODEL, "messages": messages}, headers=auth)
        assert r.status_code == 400 and error_of(r) == "invalid_request_error"


def test_keys_from_x_api_key_or_bearer_and_unknown_fields(server):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": ASK, "service_tier": "auto"}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        r = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-ignored-fields"] == "service_tier"
    # thinking is accepted (its budget must be below max_tokens, as Anthropic checks it)
    thinking = {"model": MODEL, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    r = httpx.post(server.url + "/v1/messages/count_tokens", json=thinking, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["input_tokens"] > 5
    r = httpx.post(server.url + "/v1/messages", json={**thinking, "max_tokens": 1024}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "budget_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK},
                   headers={"x-api-key": KEY + "x"})
    assert r.status_code == 401 and error_of(r) == "authentication_error"



@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "phi4_mini", "gemma3", "harmony"])
def test_text_after_a_call_is_a_block_after_it_whole_and_streamed(family):
    """Text before, between and after calls: content blocks in the order written (text, tool_use, text, tool_use,
    text), the same from the whole answer and from the stream's events on 20 random splits (the parser and the
    translation, no server: SmolLM2 does not write text after a call)."""
    import random

    from lmserve.parsers.output import OutputParser
    from lmserve.parsers.tool_formats import TOOL_FORMATS
    from lmserve.server.api.anthropic.routes import Blocks, _content
    from tests.test_parser_conformance import PARIS, SCHEMAS, WRITE

    call = WRITE[family][0]
    text = "First. " + call("get_weather", PARIS) + "\n\n" + call("search", {"q": "x"}) + "\nDone « ok ».\n"
    parser = OutputParser(None, TOOL_FORMATS[family], SCHEMAS)
    blocks, called = _content(text, parser)

    def shape(blocks):
        return [(b["type"], b["text"] if b["type"] == "text" else (b["name"], b["input"])) for b in blocks]

    assert called and shape(blocks) == [("text", "First."), ("tool_use", ("get_weather", PARIS)),
                                        ("tool_use", ("search", {"q": "x"})), ("text", "Done « ok ».")]
    rng = random.Random(family)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        streamer, encoder, streamed = parser.streamer(), Blocks(), []
        events = []
        for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
            events += encoder.feed(streamer.feed(piece))
        events += encoder.feed(streamer.finish()) + encoder.close()
        partial = {}
        for kind, body in events:  # apply the events as the SDK's stream accumulator does
            if kind == "content_block_start":
                assert body["index"] == len(streamed)
                streamed.append(dict(body["content_block"]))
                partial[body["index"]] = ""
            elif kind == "content_block_delta" and body["delta"]["type"] == "text_delta":
                streamed[body["index"]]["text"] += body["delta"]["text"]
            elif kind == "content_block_delta":
                partial[body["index"]] += body["delta"]["partial_json"]
        for i, b in enumerate(streamed):
            if b["type"] == "tool_use":
                b["input"] = json.loads(partial[i])
        assert shape(streamed) == shape(blocks), cuts
