"""Structured outputs in the engine: specs, schema checks, bounded compilation, the bitmask, and
constrained generation on the embedded model (every output valid; unconstrained neighbours unchanged;
speculative decoding still lossless under a grammar)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from lmserve import SamplingParams
from lmserve.config import StructuredOutputsConfig
from lmserve.sampling_params import StructuredOutputsParams
from lmserve.structured.compiler import GrammarCompiler, GrammarError, VocabInfo
from lmserve.structured.grammar import Grammar, fill_bitmask
from lmserve.structured.mask import apply_bitmask, reference_allowed
from lmserve.structured.schema import unsupported_keywords

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
# 300 rules of bounded repetitions: ~9 s to compile on a 2-core EPYC (the pathological case)
SLOW_GRAMMAR = ("root ::= " + " ".join(f"r{i}" for i in range(300)) + "\n"
                + "\n".join(f'r{i} ::= [a-z]{{{i % 50 + 1},{i % 50 + 40}}} "x{i}"' for i in range(300)))


def ask(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


# -- specs and schema checks (no model) -----------------------------------------------------------

def test_spec_needs_exactly_one_kind_and_names_bad_keys():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one.*json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="unknown key.*jsn"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs.kind == "choice"
    # the cache key does not depend on key order
    a = StructuredOutputsParams(json={"a": 1, "b": 2})
    assert a.spec_text == StructuredOutputsParams(json={"b": 2, "a": 1}).spec_text


def test_unsupported_schema_keywords_are_named_only_at_schema_positions():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "x": {"not": {"type": "null"}}},
              "allOf": [{"type": "object"}, {"required": ["x"]}], "enum": [{"if": 1}],
              "$defs": {"d": {"if": {"type": "string"}, "then": {"minLength": 2}}}}
    assert unsupported_keywords(schema) == ["allOf (with more than one subschema)", "if", "not", "then"]
    assert unsupported_keywords(PERSON) == []
    assert unsupported_keywords({"allOf": [{"$ref": "#/$defs/a"}]}) == []  # one subschema: what Pydantic writes


# -- the bitmask (no model) -----------------------------------------------------------------------

def test_apply_bitmask_matches_the_plain_reading_of_the_layout():
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    rows = torch.tensor([4, 0, 2])
    masked = logits.clone()
    apply_bitmask(masked, bitmask, rows)
    allowed = reference_allowed(bitmask, vocab)
    for i, r in enumerate(rows.tolist()):
        assert torch.equal(masked[r][allowed[i]], logits[r][allowed[i]])
        assert torch.isneginf(masked[r][~allowed[i]]).all()
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched


# -- compilation (the embedded model's tokenizer) -------------------------------------------------

@pytest.fixture(scope="module")
def compiler(offline_llm):
    tok = offline_llm.tokenizer
    vocab = VocabInfo(tok.vocab_tokens(), tok.vocab_type, offline_llm.engine.model_config.vocab_size,
                      sorted(tok.eos_token_ids))
    c = GrammarCompiler(vocab, StructuredOutputsConfig(compile_timeout_s=3.0))
    yield c
    c.close()


def accepts(compiled, tok, text: str) -> bool:
    g = Grammar(compiled.grammar, tok.eos_token_ids)
    return all(g.accept(t) for t in tok.encode(text, add_special_tokens=False)) and g.matcher.is_completed()


@pytest.mark.parametrize("spec, good, bad", [
    ({"json": PERSON}, '{"name": "Al", "age": 3, "role": "user", "scores": [], "address": {"city": "X", "zip": "01234"}}',
     '{"name": "Al", "age": 300, "role": "user", "scores": [], "address": {"city": "X", "zip": "01234"}}'),
    ({"json_object": True}, '{"anything": [1, {"x": null}]}', "[1, 2]"),
    ({"regex": r"\d{4}-\d{2}-\d{2}"}, "2024-02-29", "2024-2-29"),
    ({"choice": ['say "hi"', "a\\b\nc", "ünï 😀"]}, "a\\b\nc", "say hi"),
    ({"grammar": 'root ::= "yes" | "no" | "n" [0-9]+'}, "n42", "maybe"),
])
def test_each_kind_accepts_its_language_only(compiler, offline_llm, spec, good, bad):
    compiled = compiler.compile(StructuredOutputsParams.from_dict(spec))
    tok = offline_llm.tokenizer
    assert accepts(compiled, tok, good)
    assert not accepts(compiled, tok, bad)
    again = compiler.compile(StructuredOutputsParams.from_dict(spec))
    assert again.cached and again.grammar is compiled.grammar


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "objekt"}}, 'Unsupported type "objekt"'),
    ({"json": {"type": "object", "not": {"required": ["a"]}}}, "cannot enforce: not"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(a"}, "parenthesis is not closed"),
    ({"grammar": "root ::= "}, "EBNF parser error"),
])
def test_invalid_specs_name_the_problem(compiler, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        compiler.compile(StructuredOutputsParams.from_dict(spec))


def test_a_pathological_grammar_is_cut_off_and_the_compiler_recovers(compiler, offline_llm):
    start = time.monotonic()
    with pytest.raises(GrammarError, match="took longer than 3 s"):
        compiler.compile(StructuredOutputsParams(grammar=SLOW_GRAMMAR))
    assert time.monotonic() - start < 10  # bounded: not the ~9 s+ the compile would take
    fresh = compiler.compile(StructuredOutputsParams(regex="[a-c]+z"))  # a new compile process
    assert accepts(fresh, offline_llm.tokenizer, "abcz")


def test_compile_memory_is_bounded_too(offline_llm):
    tok = offline_llm.tokenizer
    vocab = VocabInfo(tok.vocab_tokens(), tok.vocab_type, offline_llm.engine.model_config.vocab_size,
                      sorted(tok.eos_token_ids))
    tight = GrammarCompiler(vocab, StructuredOutputsConfig(compile_timeout_s=60, compile_max_memory_mb=8))
    try:
        with pytest.raises(GrammarError, match="needed more than 8 MiB"):
            tight.compile(StructuredOutputsParams(grammar=SLOW_GRAMMAR))  # grows by ~30 MB while compiling
    finally:
        tight.close()


def test_drafts_fill_one_row_per_position_and_leave_the_matcher_where_it_was(compiler, offline_llm):
    tok = offline_llm.tokenizer
    compiled = compiler.compile(StructuredOutputsParams(choice=["alpha beta gamma"]))
    g = Grammar(compiled.grammar, tok.eos_token_ids)
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    assert g.valid_prefix(ids + ids) == len(ids)  # after the one choice only a stop token may follow
    mask = torch.from_numpy(fill_bitmask([(g, ids[:2], None, None)]))
    allowed = reference_allowed(mask, mask.shape[1] * 32)
    pieces = [tok.decode([t], skip_special_tokens=False) for t in range(tok.vocab_size)]
    for row in range(3):  # row r: what may follow the first r drafts = every token that is a prefix of the rest
        rest = tok.decode(ids[row:])
        want = [t for t, p in enumerate(pieces) if p and rest.startswith(p)]
        assert allowed[row].nonzero().flatten().tolist() == want
    assert g.accept(ids[0])  # the drafts were rolled back: the matcher still starts at the beginning


# -- generation on the embedded model -------------------------------------------------------------

def test_sampled_json_outputs_all_validate(offline_llm):
    prompts = [ask(offline_llm, f"Describe person number {i} as JSON.") for i in range(8)]
    params = SamplingParams(temperature=1.0, max_tokens=120, seed=7, structured_outputs={"json": PERSON})
    outs = offline_llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


def test_choice_regex_and_a_cut_off_object(offline_llm):
    llm = offline_llm
    [yes_no] = llm.generate([ask(llm, "Is the sky blue? Answer yes or no.")],
                            SamplingParams(temperature=0, max_tokens=10, structured_outputs={"choice": ["yes", "no"]}),
                            use_tqdm=False)
    assert yes_no.outputs[0].text in ("yes", "no") and yes_no.outputs[0].finish_reason == "stop"
    [date] = llm.generate(["Today's date is"], SamplingParams(temperature=0.8, seed=3, max_tokens=20,
                                                              structured_outputs={"regex": r"\d{4}-\d{2}-\d{2}"}),
                          use_tqdm=False)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.outputs[0].text)
    [cut] = llm.generate([ask(llm, "Describe a person as JSON.")],
                         SamplingParams(temperature=0, max_tokens=8, structured_outputs={"json": PERSON}), use_tqdm=False)
    # closed within the limit (structured/limit.py): it parses, and still says why it ended
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) <= 8
    assert isinstance(json.loads(cut.outputs[0].text), dict)


def test_unconstrained_neighbours_are_unchanged(offline_llm):
    llm = offline_llm
    plain = [ask(llm, t) for t in ("Tell me about cats.", "Write a haiku.", "What is 2 + 2?")]
    greedy, seeded = SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=1.0, seed=5, max_tokens=24)
    alone = llm.generate(plain, [greedy, seeded, greedy], use_tqdm=False)
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs={"json": PERSON})
    mixed = llm.generate(plain + [ask(llm, "JSON please.")] * 2, [greedy, seeded, greedy, constrained, constrained],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]


def test_greedy_speculation_under_a_grammar_equals_no_speculation(offline_llm):
    from lmserve import LLM

    spec_llm = LLM(num_threads=2, kv_cache_memory=64 * 2**20, dtype="float32",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    text = 'Copy this JSON exactly: {"name": "Ann", "age": 30, "role": "admin", "scores": [0.5], ' \
           '"address": {"city": "Oslo", "zip": "01234"}}'
    # a limit well past the answer: within ~24 tokens of max_tokens the limit steer looks every step and drafts stop
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": PERSON})
    [base] = offline_llm.generate([ask(offline_llm, text)], params, use_tqdm=False)
    [spec] = spec_llm.generate([ask(spec_llm, text)], params, use_tqdm=False)
    assert spec.outputs[0].token_ids == base.outputs[0].token_ids
    assert spec_llm.engine.spec_stats.num_accepted_tokens > 0  # drafts did run (and some were accepted)
    jsonschema.validate(json.loads(spec.outputs[0].text), PERSON)
    # a binding limit: the steer closes the answer at the same token with drafts as without (structured/limit.py)
    near = SamplingParams(temperature=0, max_tokens=44, structured_outputs={"json": PERSON})
    [base] = offline_llm.generate([ask(offline_llm, text)], near, use_tqdm=False)
    [spec] = spec_llm.generate([ask(spec_llm, text)], near, use_tqdm=False)
    assert spec.outputs[0].token_ids == base.outputs[0].token_ids and spec.outputs[0].finish_reason == "length"
    jsonschema.validate(json.loads(spec.outputs[0].text), PERSON)
