"""--reasoning-parser through a real `lmserve serve` and the official `openai` client, on a tiny random model whose
tokenizer has <think> and </think> as tokens and whose chat template opens the reasoning in the prompt (as
DeepSeek-R1 distills' do). Its output is steered only by sampling: a seed and a logit bias on "</think>", so the
reasoning ends after a few random tokens; every expectation comes from the same server's raw completion of the
same prompt and seed, never from a hard-coded text."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_util import running_server

NAME = "thinker"
USER = [{"role": "user", "content": "Is it warm in Paris?"}]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
CORPUS = ["Is it warm in Paris? Let me think about the weather.", '{"a": true, "city": "Oslo"} get_weather',
          "The answer is yes, it is warm today in the city."]
ANSWER = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
SEEDS = (1, 2, 3)


def write_thinking_tokenizer(path, corpus: list[str]):
    """A small byte-level BPE trained on `corpus`, with ChatML's specials and "<think>", "</think>" as plain added
    tokens (decoded as text, as Qwen3's and R1's are), and TEMPLATE, written under `path`; returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus * 10, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"]))
    bpe.add_tokens(["<think>", "</think>"])
    path.mkdir()
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    return bpe


def write_thinking_model(path) -> int:
    """The tiny model under `path`; returns the id of "</think>"."""
    import torch
    import transformers

    bpe = write_thinking_tokenizer(path, CORPUS)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=2048, eos_token_id=bpe.token_to_id("<|im_end|>"),
                                   bos_token_id=None, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)
    return bpe.token_to_id("</think>")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoning") / "thinker"
    end = write_thinking_model(path)
    with running_server("--model", f"{NAME}={path}", "--reasoning-parser", "deepseek_r1") as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        s.sampling = {"temperature": 1.0, "max_tokens": 40, "logit_bias": {str(end): 5}}  # "</think>": p ~ 1/3
        yield s


def chat(s, seed: int, **kw):
    return s.client.chat.completions.create(model=NAME, messages=USER, seed=seed, **{**s.sampling, **kw}).choices[0]


def streamed(s, seed: int, **kw) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, calls) joined from the chunks of a streamed chat."""
    reasoning, content, calls = "", "", []
    for chunk in s.client.chat.completions.create(model=NAME, messages=USER, seed=seed, stream=True,
                                                  **{**s.sampling, **kw}):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id:
                calls.append([tc.function.name, ""])
            calls[tc.index][1] += tc.function.arguments or ""
    return reasoning or None, content or None, [tuple(c) for c in calls]


def test_reasoning_content_splits_the_raw_text_at_its_end_tag(thinker):
    prompt = httpx.post(thinker.url + "/tokenize", json={"model": NAME, "messages": USER}).json()["tokens"]
    for seed in SEEDS:
        raw = thinker.client.completions.create(model=NAME, prompt=prompt, seed=seed, **thinker.sampling)
        text = raw.choices[0].text
        assert "</think>" in text  # the bias made the model end its reasoning (p ~ 1/3 a token)
        reasoning, _, content = text.partition("</think>")
        reasoning = reasoning.removeprefix("<think>")
        whole = chat(thinker, seed)
        assert (whole.message.reasoning_content, whole.message.content) == (reasoning or None, content or None)
        assert streamed(thinker, seed) == (reasoning or None, content or None, [])


def test_response_format_applies_only_after_the_reasoning(thinker):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for seed in SEEDS:
        free = chat(thinker, seed).message
        forced = chat(thinker, seed, response_format=fmt)
        # the grammar left the reasoning alone (same seed, same tokens), then held the answer to the schema
        assert forced.message.reasoning_content == free.reasoning_content
        jsonschema.validate(json.loads(forced.message.content), ANSWER)
        assert forced.finish_reason == "stop"
        assert streamed(thinker, seed, response_format=fmt) == (forced.message.reasoning_content,
                                                                forced.message.content, [])


def test_thinking_off_means_no_reasoning_and_the_grammar_from_the_start(thinker):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    off = chat(thinker, SEEDS[0], response_format=fmt, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(off.message.content), ANSWER)


def test_a_forced_tool_call_follows_the_reasoning_in_the_default_format(thinker):
    """The template names no tool format, so calls are hermes (the default); tool_choice required is enforced
    after "</think>" only, and the call is read from the answer, streamed or not."""
    for seed in SEEDS:
        free = chat(thinker, seed).message
        forced = chat(thinker, seed, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                      max_tokens=80)
        assert forced.message.reasoning_content == free.reasoning_content
        assert forced.finish_reason == "tool_calls" and len(forced.message.tool_calls) == 1
        call = forced.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        reasoning, content, calls = streamed(thinker, seed, tools=[WEATHER], tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=80)
        assert (reasoning, content) == (forced.message.reasoning_content, forced.message.content)
        assert calls == [(call.function.name, call.function.arguments)]


# -- a tool-call format other than the template's: --tool-call-parser pythonic on the embedded model ---------------

CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def pythonic():
    with running_server("--tool-call-parser", "pythonic") as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        yield s


def test_the_flag_sets_the_prompt_the_grammar_and_the_parser(pythonic):
    """SmolLM2's template names no format; the flag's pythonic form is what the preamble teaches, what a named
    tool_choice generates, and what comes back as tool_calls, streamed or not."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ids = httpx.post(pythonic.url + "/tokenize", json={"messages": messages, "tools": [CITY]}).json()["tokens"]
    prompt = httpx.post(pythonic.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "[<function name>(<argument name>=<value>, ...)]" in prompt
    kw = dict(model="SmolLM2-135M-Instruct", messages=messages, tools=[CITY], temperature=0, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    whole = pythonic.client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY["function"]["parameters"])
    calls = []
    for chunk in pythonic.client.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.id:
                calls.append([tc.function.name, ""])
            calls[tc.index][1] += tc.function.arguments or ""
    assert calls == [[call.name, call.arguments]]
