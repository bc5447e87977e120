"""/v1/responses (OpenAI's Responses API) through the real server, the official `openai` client and the OpenAI
Agents SDK: text, typed streams, forced function calls and their results, json_schema output, stored responses
with previous_response_id, retrieve / delete / input_items, per-key isolation, and refusals.

One server for the module (two API keys), greedy decoding, short outputs. Its second engine forward after warm-up
fails (LMSERVE_TEST_FAULT): the fixture's first request, a stream, meets it mid-stream; the server serves on.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_util import MODEL, running_server

KEY_A, KEY_B = "key-a", "key-b"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = "What is the capital of France? Answer in one short sentence."


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", KEY_A, "--api-key", KEY_B, env={"LMSERVE_TEST_FAULT": "step:2"}) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY_A)
        # Forward 1 prefills and streams a first token; forward 2 fails. Sent here, before any test, so that no
        # other request meets the fault whichever tests run.
        s.failed_events = list(c.responses.create(model=MODEL, temperature=0, input="Tell me a story.",
                                                  max_output_tokens=8, stream=True))
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A)


@pytest.fixture(scope="module")
def other(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_B)


def create(client: openai.OpenAI, **kw):
    return client.responses.create(model=MODEL, temperature=0, **kw)


def test_create_answers_a_response_object(client):
    r = create(client, input=ASK, instructions="You are terse.", max_output_tokens=48, metadata={"run": "1"},
               user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and "Paris" in r.output_text
    u = r.usage
    assert u.input_tokens > 10 and 0 < u.output_tokens <= 48 and u.total_tokens == u.input_tokens + u.output_tokens
    assert r.instructions == "You are terse." and r.metadata == {"run": "1"} and r.user == "u1" and r.store


def test_max_output_tokens_cuts_it_incomplete(client):
    r = create(client, input="Write a long story about a dragon.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_stream_sends_the_typed_events_in_order_and_equals_the_whole_answer(client):
    whole = create(client, input=ASK, max_output_tokens=48)
    with client.responses.stream(model=MODEL, temperature=0, input=ASK, max_output_tokens=48) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id != whole.id
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a stream is stored too


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = list(create(client, input="Write a long story about a dragon.", max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_an_engine_failure_mid_stream_ends_it_with_error_and_response_failed(server, client):
    events = server.failed_events
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert "response.output_text.delta" in kinds  # it failed part-way, after the first token went out
    assert events[-2].code == "engine_step_failed" and events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        client.responses.retrieve(failed.id)


def test_forced_function_call_streamed_and_whole_then_its_result_is_used(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    # One call: with parallel calls allowed the tiny model, done with its call, runs on to max_output_tokens.
    forced = {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False}
    r = create(client, input=ask, max_output_tokens=48, **forced)
    assert r.status == "completed" and r.parallel_tool_calls is False
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    events = list(create(client, input=ask, max_output_tokens=48, stream=True, **forced))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == calls[0].arguments and events[-1].type == "response.completed"
    # The call and its result go back as input items; the model answers in text (tools offered, choice none).
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny", "temp_c": 21}'}
    follow = create(client, input=[*ask, *r.output, result], tools=[TOOL], tool_choice="none", max_output_tokens=40)
    assert follow.output[0].type == "message" and follow.output_text
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    alone = create(client, input=ask, max_output_tokens=1, store=False)
    assert follow.usage.input_tokens > alone.usage.input_tokens + 20  # the call and its result were in the prompt


def test_json_schema_output_matches_the_schema(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = create(client, input="Invent a person. Reply in JSON.", text={"format": fmt}, max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    obj = create(client, input="Give me a JSON object about a cat.", text={"format": {"type": "json_object"}},
                 max_output_tokens=60)
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_continues_with_the_earlier_input_and_output(client):
    first = create(client, input="My name is Ada. Say hello to me.", max_output_tokens=24)
    second = create(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=24)
    assert second.previous_response_id == first.id
    # The same conversation sent whole gives the same prompt and, greedy, the same answer.
    whole = create(client, max_output_tokens=24, store=False, input=[
        {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.total_tokens
    assert second.output_text == whole.output_text
    items = client.responses.input_items.list(second.id).data  # newest first
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[1].id == first.output[0].id and items[0].content[0].text == "What is my name?"


def test_retrieve_input_items_pages_and_delete(client):
    r = create(client, input=[{"role": "user", "content": "One."}, {"role": "user", "content": "Two."},
                              {"role": "user", "content": "Three."}], max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.total_tokens == r.usage.total_tokens
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["One.", "Two."] and page.has_more
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id
    rest = client.responses.input_items.list(r.id, limit=2, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["Three."] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(r.id).data] == ["Three.", "Two.", "One."]
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = create(client, input="Hi.", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_another_key_cannot_read_continue_or_delete_a_stored_response(client, other, server):
    r = create(client, input="A secret: 42.", max_output_tokens=2)
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.input_items.list(r.id),
                 lambda: other.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        create(other, input="Go on.", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(r.id).id == r.id  # still there for its own key
    for method, path in (("GET", f"/v1/responses/{r.id}"), ("POST", "/v1/responses")):
        assert httpx.request(method, server.url + path, json={}).status_code == 401


@pytest.mark.parametrize("body, param", [
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input.0.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # accepted, not rendered: no message is left
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}, "tools": [TOOL]}, "tools"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "model": "no-such-model"}, "model"),
])
def test_bad_requests_are_400_or_404_in_openais_shape(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] in ("invalid_request_error",
                                                                              "not_found_error"), error
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_fields_are_ignored_and_named(server):
    body = {"model": MODEL, "input": [{"role": "user", "content": "Hi.", "extra_item_field": 1}],
            "max_output_tokens": 2, "temperature": 0, "prompt_cache_key": "k", "text": {"verbosity": "low"},
            "reasoning": {"effort": "low"}}  # known: a reasoning budget, where a reasoning parser runs
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert set(r.headers["x-ignored-fields"].split(", ")) == {"prompt_cache_key", "text.verbosity",
                                                              "input.0.extra_item_field"}


def test_an_agents_sdk_agent_calls_its_function_tool_and_uses_the_result(server, client):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.append(city)
        return f"It is sunny and 21 degrees in {city}."

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1",
                                                                                 api_key=KEY_A))
    # Forced on the first turn; the SDK resets tool_choice once the tool ran, so the next turn answers in text.
    agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False,
                                                            temperature=0, max_tokens=64))
    result = asyncio.run(Runner.run(agent, "What is the weather like in Paris?", max_turns=4))
    assert len(ran) >= 1 and isinstance(result.final_output, str) and result.final_output
    last = result.raw_responses[-1].response_id
    items = client.responses.input_items.list(last, order="asc").data
    outputs = [i for i in items if i.type == "function_call_output"]
    assert outputs and outputs[0].output == f"It is sunny and 21 degrees in {ran[0]}."


@pytest.mark.parametrize("seed", range(5))
def test_output_items_built_from_stream_pieces_equal_those_of_the_whole_answer(seed):
    """The one builder, fed a chat answer whole or as a stream's pieces (split at random), gives the same items
    (a reasoning item first when there is reasoning); the events it sends, applied in order, rebuild them (no server:
    the translation alone)."""
    import random

    from lmserve.server.api.responses.output import OutputItems, output_of_chat

    rng = random.Random(seed)
    calls = [{"id": f"call_{k}", "function": {"name": "get_weather", "arguments": '{"city":"Paris %d"}' % k}}
             for k in range(rng.randint(0, 2))]
    message = {"content": rng.choice(["", "Let me check."]) if calls else rng.choice(["", "Paris is the capital."]),
               "tool_calls": calls, "reasoning_content": rng.choice([None, "The user asks about France."])}
    whole = output_of_chat(message, "stop", OutputItems("msg_1", "rs_1"))
    out, events = OutputItems("msg_1", "rs_1"), []
    for piece in _pieces(message["reasoning_content"] or "", rng):
        events += out.reasoning(piece)
    for piece in _pieces(message["content"], rng):
        events += out.text(piece)
    for call in calls:
        events += out.call(call["id"], call["function"]["name"])
        for piece in _pieces(call["function"]["arguments"], rng):
            events += out.arguments(piece)
    events += out.finish("completed")
    strip = lambda items: [{k: v for k, v in item.items() if not (item["type"] == "function_call" and k == "id")}
                           for item in items]
    assert strip(out.items) == strip(whole)
    done = [fields["item"] for kind, fields in events if kind == "response.output_item.done"]
    assert done == out.items and [k for k, _ in events].count("response.output_item.added") == len(out.items)


def _pieces(text: str, rng) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(3, max(len(text) - 1, 0)))) if len(text) > 1 else []
    return [p for p in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])) if p]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "phi4_mini", "gemma3", "harmony"])
def test_text_after_a_call_is_a_message_after_it_whole_and_streamed(family):
    """Text before, between and after calls: output items in the order written (message, function_call, message,
    function_call, message), the same from the whole chat answer's parts and from the chat stream's chunks on 20
    random splits (the parser and the translation, no server: SmolLM2 does not write text after a call)."""
    import random

    from lmserve.parsers.events import ContentDelta
    from lmserve.parsers.output import OutputParser
    from lmserve.parsers.tool_formats import TOOL_FORMATS
    from lmserve.server.api.responses.output import OutputItems, output_of_chat
    from lmserve.server.api.responses.routes import _chat_delta
    from lmserve.server.api.tool_stream import chat_chunk_deltas
    from tests.test_parser_conformance import PARIS, SCHEMAS, WRITE

    call = WRITE[family][0]
    text = ("First. " + call("get_weather", PARIS) + "\nThen « this ».\n" + call("search", {"q": "x"})
            + "\n\nDone.\n")
    parser = OutputParser(None, TOOL_FORMATS[family], SCHEMAS)
    parsed = parser.parse(text)
    message = {"content": parsed.content, "tool_calls": [c.to_openai() for c in parsed.calls]}
    whole = output_of_chat(message, "stop", OutputItems("msg_1", "rs_1"), parsed.parts)

    def shape(items):
        return [(i["type"], i["id"] if i["type"] == "message" else i["name"],
                 i["content"][0]["text"] if i["type"] == "message" else i["arguments"]) for i in items]

    assert shape(whole) == [("message", "msg_1", "First."), ("function_call", "get_weather", '{"city":"Paris","days":2}'),
                            ("message", "msg_1_2", "Then « this »."), ("function_call", "search", '{"q":"x"}'),
                            ("message", "msg_1_3", "Done.")]
    assert parsed.content == "First.\n\nThen « this ».\n\nDone."  # chat's content: the same text, joined
    rng = random.Random(family)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        streamer, out = parser.streamer(), OutputItems("msg_1", "rs_1")
        content = ""
        for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] + [None]:
            events = streamer.feed(piece) if piece is not None else streamer.finish()
            content += "".join(e.joined for e in events if isinstance(e, ContentDelta))
            for delta in chat_chunk_deltas(events):
                _chat_delta(out, delta)
        out.finish("completed")
        assert shape(out.items) == shape(whole) and content == parsed.content, cuts
