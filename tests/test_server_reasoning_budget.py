"""Reasoning budgets, enforced in the engine (structured/reasoning_budget.py), through a real `lmserve serve` and
each API's official client: Anthropic `thinking.budget_tokens`, OpenAI chat `reasoning_effort`, Ollama `think`.

The embedded SmolLM2 has no reasoning template, so it is served with a Qwen3-style one that opens "<think>\\n"
(`--chat-template`) and `--reasoning-parser deepseek_r1` (all text before "</think>" is reasoning). SmolLM2 never
writes "</think>" by itself: every reasoning here ends because its budget was spent and the engine forced the tag.
Each budget runs 10 prompts; every one must reason at most budget + 1 tokens and then answer (non-blank content).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.server_util import MODEL, running_server

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
PROMPTS = ["What is 2 + 2?", "Name a primary colour.", "What is the capital of France?", "Is ice cold?",
           "How many legs does a cat have?", "What do bees make?", "Which is larger, 3 or 7?",
           "What colour is the sky on a clear day?", "Say hello in French.", "What is water made of?"]
BUDGETS = (16, 64, 256)
ANSWER_ROOM = 48  # max_tokens beyond the budget: the answer's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("reasoning-budget") / "qwen3_think.jinja"
    template.write_text(TEMPLATE)
    with running_server("--reasoning-parser", "deepseek_r1", "--chat-template", str(template)) as s:
        yield s


def _count(server, text: str) -> int:
    """Tokens of `text` as the server's tokenizer encodes it (no specials added)."""
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _each(fn) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch in the engine
        return list(pool.map(fn, PROMPTS))


@pytest.mark.parametrize("budget", BUDGETS)
def test_openai_reasoning_effort_bounds_the_reasoning_then_an_answer_follows(server, budget):
    """reasoning_effort "low" (1024) capped at half of max_tokens: max_tokens 2 * budget gives exactly `budget`;
    usage's reasoning_tokens counts the reasoning's tokens as generated ("</think>" included)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    def ask(prompt):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=2 * budget, reasoning_effort="low")
        return r.usage.completion_tokens_details.reasoning_tokens, r.choices[0].message

    for reasoning_tokens, message in _each(ask):
        assert 0 < reasoning_tokens <= budget + 1, (reasoning_tokens, message)
        assert message.reasoning_content and (message.content or "").strip(), message


@pytest.mark.parametrize("budget", BUDGETS)
def test_anthropic_thinking_budget_bounds_the_thinking_block_then_text_follows(server, budget):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)

    def ask(prompt):
        return client.messages.create(model=MODEL, max_tokens=budget + ANSWER_ROOM, extra_body={"temperature": 0},
                                      thinking={"type": "enabled", "budget_tokens": budget},
                                      messages=[{"role": "user", "content": prompt}])

    for m in _each(ask):
        kinds = [b.type for b in m.content]
        assert kinds == ["thinking", "text"], m.content
        thinking, text = m.content[0].thinking, m.content[1].text
        # the thinking block's text re-encoded, plus the forced "</think>" the block leaves out
        assert _count(server, thinking + "</think>") <= budget + 1, thinking
        assert text.strip(), m.content


def test_anthropic_streamed_thinking_equals_the_whole_answer(server):
    """The budget is the engine's: a stream stops its thinking at the same token as the whole answer."""
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    kw = dict(model=MODEL, max_tokens=64 + ANSWER_ROOM, extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": 64})
    for prompt in PROMPTS[:3]:
        messages = [{"role": "user", "content": prompt}]
        whole = client.messages.create(messages=messages, **kw)
        with client.messages.stream(messages=messages, **kw) as stream:
            streamed = stream.get_final_message()
        assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == \
            [b.model_dump(exclude={"signature"}) for b in whole.content]


@pytest.mark.parametrize("budget", BUDGETS)
def test_ollama_think_level_bounds_the_thinking_then_content_follows(server, budget):
    """think "low" (1024) capped at half of num_predict, as reasoning_effort is."""
    client = ollama.Client(host=server.url)

    def ask(prompt):
        return client.chat(model=MODEL, messages=[{"role": "user", "content": prompt}], think="low",
                           options={"temperature": 0, "num_predict": 2 * budget})

    for r in _each(ask):
        assert r.message.thinking and r.message.content.strip(), r.message
        assert _count(server, r.message.thinking + "</think>") <= budget + 1, r.message.thinking


def test_budget_is_validated_and_without_one_smollm2_reasons_until_max_tokens(server):
    """Without a budget nothing closes SmolLM2's reasoning: it stops inside it, with no answer (the control for the
    tests above); a bad level is a 400 in each family's error shape."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       temperature=0, max_tokens=64)
    usage = r.usage
    assert r.choices[0].message.content is None and r.choices[0].message.reasoning_content, r.choices[0]
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       reasoning_effort="extreme")
    r = httpx.post(server.url + "/v1/messages", json={
        "model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 0}})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_responses_effort_bounds_the_reasoning_and_the_json_format_starts_after_it(server):
    """Responses' reasoning.effort is chat's reasoning_effort; a json_schema format is held back until the forced
    "</think>" (the grammar never constrains the reasoning), then the answer parses and fits the schema."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"],
              "additionalProperties": False}
    budget = 32
    for prompt in PROMPTS[:3]:
        r = client.responses.create(model=MODEL, input=prompt, temperature=0, max_output_tokens=2 * budget + 64,
                                    reasoning={"effort": "low"}, store=False,
                                    text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
        assert r.reasoning.effort == "low"
        kinds = [item.type for item in r.output]
        assert kinds == ["reasoning", "message"], r.output
        assert 0 < r.usage.output_tokens_details.reasoning_tokens <= min(1024, (2 * budget + 64) // 2) + 1
        assert "answer" in json.loads(r.output_text), r.output_text
        assert not r.output[0].content[0].text.lstrip().startswith("{"), r.output[0]  # free text, not the grammar's


def test_minimal_effort_closes_the_reasoning_at_once(server):
    """minimal: budget 0, so the reasoning is the forced "</think>" alone (its tokens are the reasoning's count)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    end = _count(server, "</think>")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       temperature=0, max_tokens=32, reasoning_effort="minimal")
    assert r.usage.completion_tokens_details.reasoning_tokens == end
    assert not r.choices[0].message.reasoning_content and r.choices[0].message.content.strip()


def test_a_forced_tool_call_starts_after_the_budgeted_thinking(server):
    """tool_choice "any": the call's grammar waits behind the reasoning gate, the forced "</think>" opens it, and
    the tool_use block follows the thinking block (never inside it)."""
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                             "required": ["city"]}}
    for prompt in ("What is the weather in Paris?", "Is it raining in Oslo?"):
        m = client.messages.create(model=MODEL, max_tokens=160, extra_body={"temperature": 0}, tools=[tool],
                                   tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 24},
                                   messages=[{"role": "user", "content": prompt}])
        assert [b.type for b in m.content][:2] == ["thinking", "tool_use"], m.content
        assert "<tool_call>" not in m.content[0].thinking and _count(server, m.content[0].thinking + "</think>") <= 25
        assert m.content[1].name == "get_weather" and isinstance(m.content[1].input["city"], str)
