"""--reasoning-parser on the Anthropic, Responses and Ollama APIs, through a real `lmserve serve` and each API's
official client (`anthropic`, `openai`, `ollama`), and each API's stream translation fed random splits.

The model is tiny and wired by hand so that greedy decoding walks fixed chains of tokens: its attention and MLP
write nothing, so the last hidden state is the current token's one-hot embedding and the LM head is a table of
next-token logits. After the prompt's "<think>\\n" it writes a reasoning chain, "</think>", then an answer chain and
"<|im_end|>"; under a JSON grammar "</think>" leads into a chain that spells {"a":true} instead. Every
expectation comes from the same server's raw completion of the same prompt, never from a hard-coded text.
"""

from __future__ import annotations

import json
import random

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.server_util import running_server
from tests.test_server_reasoning import write_thinking_tokenizer
from tests.test_tools import random_splits

NAME = "chains"
ASK = "Is it warm in Paris?"
USER = [{"role": "user", "content": ASK}]
CORPUS = ["Is it warm in Paris? Let me think about the weather.", '{"a":true} {"a": true, "city": "Oslo"}',
          "The answer is yes, it is warm today in the city."]
REASONING, ANSWER, JSON_TEXT = "Let me think about", "Yes, it is warm.", '{"a":true}'  # chains with no shared token
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
MAX = 40


def write_chain_model(path) -> None:
    """The tiny model under `path` (see the module docstring)."""
    import torch
    import transformers

    bpe = write_thinking_tokenizer(path, CORPUS)
    ids = bpe.token_to_id
    vocab, hidden = bpe.get_vocab_size(), 320
    newline, end, eos = ids("Ċ"), ids("</think>"), ids("<|im_end|>")
    chains = [_unique(bpe.encode(text).ids) for text in (REASONING, ANSWER, JSON_TEXT)]
    used = [newline, end, eos]
    for chain in chains:  # each token has one successor: the chains share no token
        assert not set(chain) & set(used), (chain, used)
        used += chain
    reasoning, answer, spelled = chains
    torch.manual_seed(0)
    logits = torch.randn(vocab, vocab) * 0.1  # [current token, next token]; small noise breaks ties
    logits[:, [ids("<|im_start|>"), ids("<think>"), end, eos]] = -10.0
    logits[:, reasoning[0]] = 8.0  # from anywhere else (the prompt's "\n" too): the reasoning starts
    links = [*zip(reasoning, reasoning[1:]), (reasoning[-1], end), (end, answer[0]), *zip(answer, answer[1:]),
             (answer[-1], eos), *zip(spelled, spelled[1:]), (spelled[-1], eos)]
    for a, b in links:
        logits[a, b] = 9.0  # above the default start
    logits[end, reasoning[0]] = -10.0
    logits[end, spelled[0]] = 6.0  # second choice after "</think>": what a JSON grammar leaves
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   eos_token_id=eos, bos_token_id=None, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)  # token t -> e_t; normed: sqrt(hidden) e_t
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = logits.T / hidden ** 0.5
    model.save_pretrained(path, safe_serialization=True)


def _unique(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoning-apis") / NAME
    write_chain_model(path)
    with running_server("--model", f"{NAME}={path}", "--reasoning-parser", "deepseek_r1") as s:
        prompt = httpx.post(s.url + "/tokenize", json={"model": NAME, "messages": USER}).json()["tokens"]
        oa = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        raw = oa.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=MAX, logprobs=0)
        text = raw.choices[0].text
        s.reasoning, _, s.answer = text.partition("</think>")
        assert s.reasoning and s.answer and "</think>" not in s.answer, (text, raw.choices[0].logprobs.tokens)
        # the reasoning's tokens, "</think>" included (its own token), as usage counts them
        s.reasoning_tokens = raw.choices[0].logprobs.tokens.index("</think>") + 1
        s.oa, s.an = oa, anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
        s.ol = ollama.Client(host=s.url, timeout=120)
        yield s


def test_chat_usage_counts_the_reasoning_tokens_streamed_or_not(server):
    kw = dict(model=NAME, messages=USER, temperature=0, max_tokens=MAX)
    whole = server.oa.chat.completions.create(**kw)
    assert whole.usage.completion_tokens_details.reasoning_tokens == server.reasoning_tokens
    [last] = [c for c in server.oa.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
              if c.usage is not None]
    assert last.usage.model_dump() == whole.usage.model_dump()


# -- Anthropic Messages ----------------------------------------------------------------------------------------


def _blocks(content) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in content]


def test_messages_carry_a_thinking_block_before_the_text(server):
    kw = dict(model=NAME, max_tokens=MAX, messages=USER, extra_body={"temperature": 0})  # an extra in this SDK
    whole = server.an.messages.create(**kw)
    assert _blocks(whole.content) == [{"type": "thinking", "thinking": server.reasoning, "signature": ""},
                                      {"type": "text", "text": server.answer}]
    assert whole.stop_reason == "end_turn"
    with server.an.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _blocks(final.content) == _blocks(whole.content)
    kinds = [(e.type, e.delta.type if e.type == "content_block_delta" else
              e.content_block.type if e.type == "content_block_start" else None)
             for e in events if e.type.startswith("content_block")]
    thinking = [k for k in kinds if k[1] == "thinking_delta"]
    assert kinds[0] == ("content_block_start", "thinking") and thinking
    assert kinds[len(thinking) + 1:len(thinking) + 4] == [("content_block_delta", "signature_delta"),
                                                          ("content_block_stop", None),
                                                          ("content_block_start", "text")]


def test_messages_thinking_disabled_means_one_text_block(server):
    off = server.an.messages.create(model=NAME, max_tokens=MAX, messages=USER, thinking={"type": "disabled"},
                                    extra_body={"temperature": 0})
    assert _blocks(off.content) == [{"type": "text", "text": server.reasoning + "</think>" + server.answer}]


@pytest.mark.parametrize("seed", range(20))
def test_messages_stream_translation_equals_the_whole_answer_on_random_splits(seed):
    """The blocks rebuilt from the SSE events of a random split equal the whole answer's blocks."""
    from lmserve.parsers.reasoning import REASONING_PARSERS
    from lmserve.parsers.tool_formats import HERMES
    from lmserve.server.api.anthropic.routes import Blocks, _content
    from lmserve.server.api.tools import output_parser

    rng = random.Random(seed)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    tools = rng.choice([[], [weather]])
    call = HERMES.format_call("get_weather", '{"city": "Paris"}') if tools and rng.random() < 0.6 else ""
    text = rng.choice(["<think>", ""]) + rng.choice(["", "Hmm, warm?"]) + rng.choice(["</think>", ""]) + \
        rng.choice(["", "\n\nYes, it is warm."]) + call
    parser = output_parser(tools, HERMES, REASONING_PARSERS["deepseek_r1"])
    expected, _ = _content(text, parser)
    for pieces in random_splits(text, rng, 5) + [list(text)]:
        streamer, blocks, events = parser.streamer(), Blocks(), []
        for piece in pieces:
            events += blocks.feed(streamer.feed(piece))
        events += blocks.feed(streamer.finish()) + blocks.close()
        assert _without_ids(_rebuilt(events)) == _without_ids(expected), pieces


def _without_ids(blocks: list[dict]) -> list[dict]:
    """Blocks without their tool_use ids (random per parse)."""
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def _rebuilt(events: list[tuple[str, dict]]) -> list[dict]:
    """Content blocks as a client accumulates them from content_block_start / _delta events."""
    blocks: list[dict] = []
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
            assert data["index"] == len(blocks) - 1
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature",
                     "input_json_delta": "partial"}[delta["type"]]
            value = delta["partial_json" if field == "partial" else field]
            block[field] = (block.get(field, "") + value) if field != "signature" else value
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial", "") or "{}")
    return blocks


# -- Responses ---------------------------------------------------------------------------------------------------


def test_responses_carry_a_reasoning_item_and_count_its_tokens(server):
    whole = server.oa.responses.create(model=NAME, input=ASK, temperature=0, max_output_tokens=MAX)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.id.startswith("rs_")
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", server.reasoning)]
    assert message.type == "message" and whole.output_text == server.answer
    assert whole.usage.output_tokens_details.reasoning_tokens == server.reasoning_tokens
    with server.oa.responses.stream(model=NAME, input=ASK, temperature=0, max_output_tokens=MAX) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _items(final) == _items(whole)
    assert final.usage.output_tokens_details.reasoning_tokens == server.reasoning_tokens
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.reasoning_text.done") \
        < kinds.index("response.output_text.delta")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == server.reasoning
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == server.reasoning and done.item_id == final.output[0].id


def test_responses_take_a_reasoning_item_back_without_rendering_it(server):
    first = server.oa.responses.create(model=NAME, input=ASK, temperature=0, max_output_tokens=MAX, store=False)
    turn = [{"role": "user", "content": ASK}, *[i.model_dump(exclude_none=True) for i in first.output],
            {"role": "user", "content": "And in Oslo?"}]
    without = [item for item in turn if item.get("type") != "reasoning"]
    count = lambda items: server.oa.responses.create(model=NAME, input=items, temperature=0, max_output_tokens=1,
                                                     store=False).usage.input_tokens
    assert turn[1]["type"] == "reasoning" and count(turn) == count(without)


def test_responses_text_format_applies_after_the_reasoning(server):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    forced = server.oa.responses.create(model=NAME, input=ASK, temperature=0, max_output_tokens=MAX, text=fmt)
    reasoning = forced.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text == server.reasoning
    jsonschema.validate(json.loads(forced.output_text), SCHEMA)
    with server.oa.responses.stream(model=NAME, input=ASK, temperature=0, max_output_tokens=MAX, text=fmt) as s:
        list(s)
        assert _items(s.get_final_response()) == _items(forced)


def _items(response) -> list[dict]:
    """A response's output items without their ids (named after each response) and the stream helper's `parsed`."""
    items = [i.model_dump(exclude={"id"}) for i in response.output]
    for item in items:
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return items


# -- Ollama ------------------------------------------------------------------------------------------------------

GREEDY = {"temperature": 0, "num_predict": MAX}


def test_ollama_chat_splits_thinking_streamed_or_not(server):
    whole = server.ol.chat(model=NAME, messages=USER, options=GREEDY)
    assert (whole.message.thinking, whole.message.content) == (server.reasoning, server.answer)
    parts = list(server.ol.chat(model=NAME, messages=USER, options=GREEDY, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == server.reasoning
    assert "".join(p.message.content for p in parts) == server.answer
    assert any(p.message.thinking for p in parts[1:])  # thinking arrives as deltas, not in one piece
    off = server.ol.chat(model=NAME, messages=USER, options=GREEDY, think=False)
    assert off.message.thinking is None and off.message.content == server.reasoning + "</think>" + server.answer


def test_ollama_generate_splits_thinking_streamed_or_not(server):
    whole = server.ol.generate(model=NAME, prompt=ASK, options=GREEDY)
    assert (whole.thinking, whole.response) == (server.reasoning, server.answer)
    parts = list(server.ol.generate(model=NAME, prompt=ASK, options=GREEDY, stream=True))
    assert "".join(p.thinking or "" for p in parts) == server.reasoning
    assert "".join(p.response for p in parts) == server.answer


def test_ollama_format_applies_after_the_thinking(server):
    for fmt in ("json", SCHEMA):
        r = server.ol.chat(model=NAME, messages=USER, options=GREEDY, format=fmt)
        assert r.message.thinking == server.reasoning
        jsonschema.validate(json.loads(r.message.content), SCHEMA)
        parts = list(server.ol.chat(model=NAME, messages=USER, options=GREEDY, format=fmt, stream=True))
        assert "".join(p.message.content for p in parts) == r.message.content


@pytest.mark.parametrize("seed", range(20))
def test_ollama_stream_lines_equal_the_whole_answer_on_random_splits(seed):
    """The NDJSON lines' thinking and content, joined, equal the whole answer's, for any split of the text."""
    from lmserve.parsers.reasoning import REASONING_PARSERS
    from lmserve.parsers.tool_formats import HERMES
    from lmserve.server.api.ollama.routes import _message, _split
    from lmserve.server.api.tools import output_parser

    rng = random.Random(seed)
    text = rng.choice(["<think>", ""]) + rng.choice(["", "Hmm, warm?"]) + rng.choice(["</think>", ""]) + \
        rng.choice(["", "\n\nYes, it is warm."])
    parser = output_parser([], HERMES, REASONING_PARSERS[rng.choice(["deepseek_r1", "qwen3"])])
    whole = _message(text, parser)
    for pieces in random_splits(text, rng, 5) + [list(text)]:
        streamer, thinking, content = parser.streamer(), "", ""
        for events in [*(streamer.feed(p) for p in pieces), streamer.finish()]:
            t, c = _split(events)
            thinking, content = thinking + t, content + c
        assert (thinking or None, content) == (whole.get("thinking"), whole["content"]), pieces
