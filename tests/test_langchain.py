"""langchain-openai's ChatOpenAI pointed at a real `lmserve serve`: invoke, stream, bind_tools, with_structured_output."""

from __future__ import annotations

import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.server_util import MODEL


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def chat(server):
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=24,
                      max_retries=0)


def test_invoke_and_stream_agree(chat):
    question = "What is the capital of France?"
    reply = chat.invoke(question)
    assert reply.content.strip() and reply.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(chunk.content for chunk in chat.stream(question)) == reply.content


@pytest.fixture(scope="module")
def roomy(server):
    """Room for a whole tool call or JSON object (the grammar makes them parse once they are complete)."""
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=96,
                      max_retries=0)


def test_bind_tools_gives_a_parsed_call(roomy):
    bound = roomy.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    reply = bound.invoke("What is the weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    assert get_weather.invoke(call["args"]).startswith("sunny in")


def test_with_structured_output_gives_the_model(roomy):
    city = roomy.with_structured_output(City).invoke("Name a city in Italy.")  # json_schema, the default method
    assert isinstance(city, City) and city.name and city.country
