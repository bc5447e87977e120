"""Malformed files never crash a loader (issue 47, finding 8: six of the probe's 62 files gave tracebacks, one an
HTTP 500). A seeded generator mutates small valid files made here (a GGUF model with its vocabulary, a Hugging Face
directory, a PEFT adapter): truncation, bit flips in headers, wrong types, zero/negative/huge counts and offsets,
deep nesting, wrong dtypes, offsets past the end: about 400 cases (177 GGUF, 153 for a Hugging Face directory, 75
adapters). Each case goes to the loaders in this process under a per-case timeout and must load, or be refused
with the project's error (CheckpointError; AdapterError for an adapter) in one line naming the file; any other
exception, or a case past its timeout, fails. Then bad adapters go through the real server's load route as a key
holder would send them: a 400 in the OpenAI error shape, and the server still answers. (`lmserve serve` on the
probe's files: tests/test_cli_errors.py.)"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
import torch

from lmserve.errors import CheckpointError
from lmserve.loader import load_model, read_model_config
from lmserve.lora.peft_adapter import AdapterError, read_peft_adapter
from lmserve.tokenizer import Tokenizer
from lmserve.tokenizer.tokenizer import check_tokenizer_file
from tests import bad_files as bf
from tests.bad_files import ARR, BOOL, F32, I32, I64, STR, U32, U64
from tests.conftest import write_tiny_llama
from tests.lora_adapters import write_random_adapter
from tests.server_util import running_server

CPU = torch.device("cpu")
SEED = 47
CASE_TIMEOUT_S = 30.0  # generous (the host is shared): a case past it is a hang
Case = tuple[str, str, bytes]  # name, the file it replaces, its bytes


class CaseTimedOut(BaseException):
    """A case ran past CASE_TIMEOUT_S (a BaseException: no `except Exception` in a loader swallows it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise CaseTimedOut()

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cases(base: Path, cases: list[Case], root: Path, load: Callable[[Path], None],
              refusal: type[Exception]) -> dict[str, int]:
    """Each case in a directory of its own (the base's other files hard-linked); asserts every case loads or is
    refused in one line naming a file; returns how many did which."""
    outcomes, failures = {"loaded": 0, "refused": 0}, []
    for i, (name, filename, data) in enumerate(cases):
        case = root / f"case-{i:03d}"
        case.mkdir(parents=True)
        for f in base.iterdir():
            if f.name != filename:
                os.link(f, case / f.name)
        (case / filename).write_bytes(data)
        try:
            with time_limit(CASE_TIMEOUT_S):
                load(case)
            outcomes["loaded"] += 1
        except refusal as e:
            message, names = str(e), [case.name, *(f.name for f in case.iterdir())]
            if "\n" in message or not any(n in message for n in names):
                failures.append(f"{name}: refused, but not in one line naming the file: {message[:300]!r}")
            outcomes["refused"] += 1
        except CaseTimedOut:
            failures.append(f"{name}: still running after {CASE_TIMEOUT_S} s")
        except BaseException as e:  # what the test is for: a traceback a user would have seen (a Rust panic too)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
    return outcomes


# -- byte-level mutations ----------------------------------------------------------------------------------------

EXTREMES = (0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1)


def truncations(name: str, filename: str, data: bytes, rng: random.Random, n: int) -> list[Case]:
    return [(f"{name} cut at {at}", filename, data[:at]) for at in sorted(rng.sample(range(len(data)), n))]


def bit_flips(name: str, filename: str, data: bytes, rng: random.Random, n: int, end: int) -> list[Case]:
    """`n` cases of one to three flipped bits in data[:end] (the header)."""
    out = []
    for _ in range(n):
        raw = bytearray(data)
        for at in rng.sample(range(end), rng.randint(1, 3)):
            raw[at] ^= 1 << rng.randrange(8)
        out.append((f"{name} bits flipped near {at}", filename, bytes(raw)))
    return out


def extremes(name: str, filename: str, data: bytes, rng: random.Random, n: int, end: int) -> list[Case]:
    """`n` cases of an extreme u64 written over data[:end] (a count, a length or an offset, where it lands on one)."""
    out = []
    for _ in range(n):
        at, value = rng.randrange(end - 8), rng.choice(EXTREMES)
        out.append((f"{name} u64 {value} at {at}", filename, data[:at] + struct.pack("<Q", value) + data[at + 8:]))
    return out


# -- GGUF --------------------------------------------------------------------------------------------------------

WRONG_NUMBERS = [(U32, 0), (I32, -1), (I64, -2**63), (U64, 2**64 - 1), (U32, 2**32 - 1), (STR, "32"), (F32, 0.5),
                 (F32, float("nan")), (BOOL, True), (ARR, (U32, [1, 2])), (ARR, (STR, []))]
WRONG_FLOATS = [(F32, 0.0), (F32, float("nan")), (F32, -1.0), (F32, float("inf")), (STR, "x"), (ARR, (F32, [1.0]))]
SIZE_KEYS = ("context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "rope.dimension_count")
TOKENIZER_EDITS = [
    ("tokenizer.ggml.tokens", (U32, 5)), ("tokenizer.ggml.tokens", (ARR, (U32, [1] * len(bf.TOKENS)))),
    ("tokenizer.ggml.tokens", (ARR, (STR, bf.TOKENS[:10]))), ("tokenizer.ggml.merges", (ARR, (STR, ["a"]))),
    ("tokenizer.ggml.merges", (ARR, (STR, ["q zz"]))), ("tokenizer.ggml.merges", (U32, 1)),
    ("tokenizer.ggml.token_type", (ARR, (STR, ["x"] * len(bf.TOKENS)))),
    ("tokenizer.ggml.token_type", (ARR, (I32, [3]))),
    ("tokenizer.ggml.token_type", (U32, 3)), ("tokenizer.ggml.bos_token_id", (U32, 10**6)),
    ("tokenizer.ggml.bos_token_id", (STR, "0")), ("tokenizer.ggml.eos_token_id", (F32, 1.5)),
    ("tokenizer.ggml.model", (U32, 3)), ("tokenizer.ggml.model", (STR, "rwkv")), ("tokenizer.ggml.pre", (U32, 1)),
    ("tokenizer.ggml.pre", (STR, "mystery")), ("tokenizer.ggml.add_bos_token", (STR, "yes")),
    ("tokenizer.chat_template", (U32, 5)), ("general.architecture", (U32, 5)),
    ("general.architecture", (STR, "mystery")), ("general.file_type", (STR, "Q4")),
    ("llama.rope.scaling.type", (STR, "yarn")), ("llama.rope.scaling.type", (STR, "mystery")),
    ("llama.rope.scaling.type", (U32, 1)),
]


def load_gguf(case: Path) -> None:
    path = case / "model.gguf"
    read_model_config(path)
    loaded = load_model(path, torch.float32, CPU)
    Tokenizer.from_gguf(path, loaded.gguf.metadata).encode("abcd ab")


def gguf_cases(rng: random.Random) -> list[Case]:
    """About 180 GGUF files: every size key and the alignment given wrong values, floats out of range, tokenizer and
    architecture keys of the wrong type, nested arrays, tensors with wrong dims, types and offsets, broken header
    counts, then truncations, bit flips and extreme numbers at random places in the header."""
    tensors = bf.tiny_tensors()
    data_bytes = sum(len(raw) + -len(raw) % 32 for *_, raw in tensors)

    def meta(edit: Callable[[dict], None], **kwargs: Any) -> bytes:
        m = bf.tiny_meta()
        edit(m)
        return bf.gguf_bytes(m, kwargs.pop("tensors", tensors), **kwargs)

    def one(key: str, value: Any) -> Callable[[dict], None]:
        return lambda m: m.update({key: value})

    def drop(key: str) -> Callable[[dict], None]:
        return lambda m: m.pop(key)

    cases: list[tuple[str, bytes]] = [("valid", meta(lambda m: None)),
                                      ("alignment 64", meta(one("general.alignment", (U32, 64)), alignment=64))]
    for key in SIZE_KEYS:
        cases += [(f"{key} = {v}", meta(one(f"llama.{key}", v))) for v in rng.sample(WRONG_NUMBERS, 5)]
    cases += [(f"alignment = {v}", meta(one("general.alignment", v)))
              for v in [(U32, 0), (STR, "32"), (U32, 3), (U64, 2**40), (F32, 32.0), (I32, -32), (BOOL, True)]]
    for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        cases += [(f"{key} = {v}", meta(one(f"llama.{key}", v))) for v in rng.sample(WRONG_FLOATS, 4)]
    cases += [(f"{k} = {v}", meta(one(k, v))) for k, v in TOKENIZER_EDITS]
    cases += [("linear rope, factor 0", meta(lambda m: m.update({"llama.rope.scaling.type": (STR, "linear"),
                                                                 "llama.rope.scaling.factor": (F32, 0.0)}))),
              ("yarn, original context 0", meta(lambda m: m.update({
                  "llama.rope.scaling.type": (STR, "yarn"), "llama.rope.scaling.factor": (F32, 4.0),
                  "llama.rope.scaling.original_context_length": (U32, 0)})))]
    cases += [(f"no {k}", meta(drop(k))) for k in ("general.architecture", "llama.context_length",
              "llama.embedding_length", "llama.feed_forward_length", "llama.block_count", "llama.attention.head_count",
              "llama.attention.layer_norm_rms_epsilon")]
    cases += [(f"arrays nested {d} deep", meta(one("deep", bf.nested_gguf_array(d)))) for d in (bf.ISSUE_NESTING, 9, 8)]
    cases += [("a string array of 2**40", meta(one("big", struct.pack("<IIQ", ARR, STR, 2**40)))),
              ("a u8 array of 2**62", meta(one("big", struct.pack("<IIQ", ARR, 0, 2**62)))),
              ("an unknown value type", meta(one("odd", struct.pack("<I", 77))))]
    cases += [(name, meta(lambda m: None, tensors=edit(list(tensors)))) for name, edit in _tensor_edits(tensors)]
    valid = cases[0][1]
    cases += [("version 1", valid[:4] + struct.pack("<I", 1) + valid[8:]),
              ("2**40 tensors", valid[:8] + struct.pack("<Q", 2**40) + valid[16:]),
              ("2**40 keys", valid[:16] + struct.pack("<Q", 2**40) + valid[24:]),
              ("13 tensors claimed", valid[:8] + struct.pack("<Q", 13) + valid[16:]),
              ("bad magic", b"GGUX" + valid[4:]), ("empty", b""), ("magic only", b"GGUF")]
    header = len(valid) - data_bytes
    out = [(name, "model.gguf", data) for name, data in cases]
    out += truncations("gguf", "model.gguf", valid, rng, 20)
    out += bit_flips("gguf header", "model.gguf", valid, rng, 25, header)
    out += extremes("gguf header", "model.gguf", valid, rng, 15, header)
    return out


def _tensor_edits(tensors: list[bf.Tensor]) -> list[tuple[str, Callable[[list], list]]]:
    """(case, a function from the tensor list to the edited list)."""
    def at(name: str, change: Callable[[bf.Tensor], bf.Tensor | None]) -> Callable[[list], list]:
        return lambda ts: [y for t in ts if (y := change(t) if t[0] == name else t) is not None]

    return [
        ("no token_embd", at("token_embd.weight", lambda t: None)),
        ("no attn_q", at("blk.0.attn_q.weight", lambda t: None)),
        ("dims 2**62 x 2**62", at("token_embd.weight", lambda t: (t[0], (2**62, 2**62), t[2], t[3]))),
        ("dims 2**64-1", at("output_norm.weight", lambda t: (t[0], (2**64 - 1,), t[2], t[3]))),
        ("a zero dim", at("token_embd.weight", lambda t: (t[0], (0, t[1][1]), t[2], b""))),
        ("0 dims", at("output_norm.weight", lambda t: (t[0], (), t[2], t[3]))),
        ("5 dims", at("output_norm.weight", lambda t: (t[0], (1, 1, 1, 1, 32), t[2], t[3]))),
        ("wrong shape", at("blk.0.attn_q.weight", lambda t: (t[0], (32, 16), t[2], t[3][:32 * 16 * 4]))),
        ("unknown type", at("blk.0.attn_k.weight", lambda t: (t[0], t[1], 99, t[3]))),
        ("Q8_0 row of 33", at("blk.0.ffn_up.weight", lambda t: (t[0], (33, 64), t[2], t[3]))),
        ("F16 read as F32", at("output.weight", lambda t: (t[0], t[1], bf.F32_TYPE, t[3]))),
        ("a tensor twice", lambda ts: ts + [ts[0]]),
        ("an unknown tensor", lambda ts: ts + [("blk.0.mystery.weight", (32,), bf.F32_TYPE, bytes(128))]),
        ("a layer past block_count", lambda ts: ts + [("blk.7.attn_norm.weight", (32,), bf.F32_TYPE, bytes(128))]),
    ]


def test_gguf_fuzz(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    cases = gguf_cases(random.Random(SEED))
    outcomes = run_cases(base, cases, tmp_path / "cases", load_gguf, CheckpointError)
    assert outcomes["loaded"] >= 2 and outcomes["refused"] >= len(cases) // 2, outcomes  # both sides are exercised


def test_offsets_past_the_end_are_refused(tmp_path):
    """A tensor offset past the end of the file, however large, names the tensor (a u64 offset cannot wrap)."""
    valid = bf.gguf_bytes(bf.tiny_meta(), bf.tiny_tensors())
    info = valid.index(bf.gguf_string("output_norm.weight"))
    at = info + len(bf.gguf_string("output_norm.weight")) + 4 + 8 + 4  # n_dims, one dim, type: then the offset
    for offset in (len(valid), 2**40, 2**64 - 1):
        path = tmp_path / f"offset-{offset}.gguf"
        path.write_bytes(valid[:at] + struct.pack("<Q", offset) + valid[at + 8:])
        with pytest.raises(CheckpointError, match=rf"{path.name}: tensor 'output_norm.weight' extends past the end"):
            read_model_config(path)


# -- a Hugging Face directory: config.json, model.safetensors, tokenizer.json, tokenizer_config.json --------------

WRONG_JSON = [0, -1, 10**30, "8", None, [1], {"a": 1}, 1.5, True, float("nan"), 2**63]
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "head_dim", "rms_norm_eps", "rope_theta",
               "eos_token_id", "bos_token_id", "tie_word_embeddings", "sliding_window")
CONFIG_EDITS = [
    ("architectures", [{"a": 1}]), ("architectures", "LlamaForCausalLM"), ("architectures", []),
    ("architectures", ["Mystery"]), ("architectures", 5),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}), ("rope_scaling", {"rope_type": "mystery"}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8}), ("rope_scaling", ["x"]), ("rope_scaling", "linear"),
    ("rope_scaling", {"rope_type": "yarn", "factor": -1, "original_max_position_embeddings": 0}),
    ("rope_scaling", {"rope_type": "longrope", "short_factor": [1], "long_factor": [1],
                      "original_max_position_embeddings": 1}),
    ("layer_types", [1, 2, 3]), ("layer_types", ["sliding"] * 3), ("layer_types", ["full"]),
    ("quantization_config", {"quant_method": "gptq", "bits": "x"}), ("quantization_config", ["gptq"]),
    ("quantization_config", {"quant_method": 5}),
]


def load_hf(case: Path) -> None:
    read_model_config(case)
    check_tokenizer_file(case)
    Tokenizer.from_pretrained(case).encode("w1 w2")
    load_model(case, torch.float32, CPU)


def json_file_cases(filename: str, valid: bytes, rng: random.Random) -> list[Case]:
    """A JSON file replaced whole: nested past any recursion limit and just past ours, not an object, not JSON,
    truncated, bits flipped anywhere."""
    cases = [(f"{filename} nested {d} deep", filename, bf.nested_into(valid.decode(), d).encode())
             for d in (bf.ISSUE_NESTING, 64, 62)]  # 62 deep in the object: 63 levels, inside the bound
    # UTF-16 (json.loads reads it): U+4E22's bytes hold a quote's, which a byte scan would take for a string's end
    hidden = '{"z": "\u4e22", "nested": ' + bf.nested_json(bf.ISSUE_NESTING) + "}"
    cases.append((f"{filename} nested deep in UTF-16", filename, hidden.encode("utf-16-le")))
    cases += [(f"{filename} = {raw!r}", filename, raw) for raw in (b"[]", b"null", b"", b"{", b"\xff\xfe\x00garbage")]
    cases += truncations(filename, filename, valid, rng, 4)
    cases += bit_flips(filename, filename, valid, rng, 4, len(valid))
    return cases


def config_cases(valid: bytes, rng: random.Random) -> list[Case]:
    """About 80 config.json files: each size and rope key given wrong values, odd architectures, rope scalings,
    layer types and quantization configs, the file nested deep or broken."""
    cfg = json.loads(valid)

    def edited(key: str, value: Any) -> Case:
        return f"config.json {key} = {value!r}", "config.json", json.dumps(cfg | {key: value}).encode()

    cases = [edited(k, v) for k in CONFIG_KEYS for v in rng.sample(WRONG_JSON, 3)]
    cases += [edited(k, v) for k, v in CONFIG_EDITS]
    cases += [("config.json in UTF-16", "config.json", json.dumps(cfg).encode("utf-16"))]
    return cases + json_file_cases("config.json", valid, rng)


def safetensors_parts(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def safetensors_join(header: dict | bytes, data: bytes) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def safetensors_cases(filename: str, valid: bytes, rng: random.Random) -> list[Case]:
    """About 35 versions of a safetensors file: its header length, one tensor's dtype, shape and data offsets made
    wrong, the header nested deep or not JSON, truncations and bit flips."""
    header, data = safetensors_parts(valid)
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    entry = header[name]
    end = 8 + len(valid) - len(data) - 8

    def entry_case(what: str, change: dict) -> Case:
        return f"{filename} {name} {what}", filename, safetensors_join(header | {name: entry | change}, data)

    n = struct.unpack("<Q", valid[:8])[0]
    cases = [(f"{filename} header length {v}", filename, struct.pack("<Q", v) + valid[8:])
             for v in (0, n - 1, n + 1, 2**63, 2**64 - 1)]
    cases += [entry_case(f"dtype {d}", {"dtype": d}) for d in ("F99", "I8", "BOOL", "F16", 5)]
    cases += [entry_case(f"shape {s}", {"shape": s}) for s in ([-1, 128], [2**40, 2**40], [], [3, 5], "x")]
    lo, hi = entry["data_offsets"]
    cases += [entry_case(f"offsets {o}", {"data_offsets": o})
              for o in ([0, 10**12], [hi, lo], [lo, lo], [len(data), len(data) + 4], [-8, hi], [lo])]
    cases += [(f"{filename} {what}", filename, safetensors_join(h, data)) for what, h in (
        ("entry not an object", header | {"x": 5}),
        ("metadata not strings", header | {"__metadata__": {"a": {"b": 1}}}),
        ("header an array", b"[]"), ("header not UTF-8", b"\xff" * 16),
        ("header nested deep", b'{"__metadata__": ' + bf.nested_json(bf.ISSUE_NESTING).encode() + b"}"))]
    cases += truncations(filename, filename, valid, rng, 6)
    cases += bit_flips(f"{filename} header", filename, valid, rng, 6, end)
    return cases


def tokenizer_cases(valid: bytes, config: bytes, rng: random.Random) -> list[Case]:
    """About 35 tokenizer files: tokenizer.json's model and pipeline given wrong types, a BPE model whose merges
    name unknown tokens, the file nested deep or broken; tokenizer_config.json with wrong types or nested deep."""
    tok = json.loads(valid)

    def edited(key: str, value: Any) -> Case:
        return f"tokenizer.json {key} = {str(value)[:40]}", "tokenizer.json", json.dumps(tok | {key: value}).encode()

    model = tok["model"]
    cases = [edited("model", model | change) for change in (
        {"type": "Mystery"}, {"vocab": [1, 2]}, {"vocab": {"w": "x"}}, {"unk_token": 5}, {"vocab": {}})]
    cases += [edited(k, v) for k, v in (
        ("model", "x"), ("model", {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}),
        ("pre_tokenizer", {"type": "Mystery"}), ("added_tokens", [{"id": "x"}]), ("added_tokens", "x"),
        ("normalizer", {"type": "Replace"}), ("decoder", {"type": "Sequence", "decoders": 5}),
        ("post_processor", {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<nope>",
                                                                                        "type_id": 0}}],
                            "pair": [], "special_tokens": {}}))]
    cases += json_file_cases("tokenizer.json", valid, rng)
    cfg = json.loads(config)
    cases += [(f"tokenizer_config.json {k} = {v!r}", "tokenizer_config.json", json.dumps(cfg | {k: v}).encode())
              for k, v in (("chat_template", 5), ("bos_token", ["x"]), ("eos_token", {"content": 5}),
                           ("chat_template", [{"name": "default"}]))]
    cases += [(name, "tokenizer_config.json", data) for name, _, data in (
        ("tokenizer_config.json nested deep", "", b'{"nested": ' + bf.nested_json(bf.ISSUE_NESTING).encode() + b"}"),
        ("tokenizer_config.json = []", "", b"[]"), ("tokenizer_config.json = {", "", b"{"))]
    return cases


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny"
    write_tiny_llama(path)  # config.json, model.safetensors, tokenizer.json (word level)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def test_hf_directory_fuzz(hf_dir, tmp_path):
    rng = random.Random(SEED + 1)
    cases = config_cases((hf_dir / "config.json").read_bytes(), rng)
    cases += safetensors_cases("model.safetensors", (hf_dir / "model.safetensors").read_bytes(), rng)
    cases += tokenizer_cases((hf_dir / "tokenizer.json").read_bytes(), (hf_dir / "tokenizer_config.json").read_bytes(),
                             rng)
    outcomes = run_cases(hf_dir, cases, tmp_path / "cases", load_hf, CheckpointError)
    assert outcomes["loaded"] >= 2 and outcomes["refused"] >= len(cases) // 2, outcomes


# -- PEFT adapters ------------------------------------------------------------------------------------------------

ADAPTER_CONFIG_EDITS = [
    ("target_modules", "q_proj"), ("target_modules", [5]), ("target_modules", [["q_proj"]]), ("target_modules", "*["),
    ("rank_pattern", {"(": 4}), ("rank_pattern", [1]), ("rank_pattern", {"q_proj": "x"}),
    ("rank_pattern", {"q_proj": 0}),
    ("rank_pattern", {"(" * 5000 + ")" * 5000: 4}), ("alpha_pattern", {"q_proj": -1}), ("peft_type", 5),
    ("use_rslora", "yes"),
]


def adapter_cases(config: bytes, weights: bytes, rng: random.Random) -> list[Case]:
    """About 50 adapters: adapter_config.json's rank, alpha, targets and patterns given wrong values, the file nested
    deep or broken; adapter_model.safetensors as safetensors_cases breaks it."""
    cfg = json.loads(config)

    def edited(key: str, value: Any) -> Case:
        name = f"adapter_config.json {key} = {str(value)[:40]}"
        return name, "adapter_config.json", json.dumps(cfg | {key: value}).encode()

    cases = [edited("r", v) for v in rng.sample(WRONG_JSON + [1e308, 8.5], 5)]
    cases += [edited("lora_alpha", v) for v in rng.sample(WRONG_JSON, 3)]
    cases += [edited(k, v) for k, v in ADAPTER_CONFIG_EDITS]
    cases += json_file_cases("adapter_config.json", config, rng)
    return cases + safetensors_cases("adapter_model.safetensors", weights, rng)


@pytest.fixture(scope="module")
def adapter_base(hf_dir, tmp_path_factory) -> tuple[Path, Any]:
    cfg = read_model_config(hf_dir)
    path = write_random_adapter(tmp_path_factory.mktemp("adapter") / "a", cfg, rank=4,
                                target_modules=("q_proj", "v_proj"))
    return path, cfg


def test_adapter_fuzz(adapter_base, tmp_path):
    path, cfg = adapter_base
    files = [(path / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")]
    cases = adapter_cases(*files, random.Random(SEED + 2))
    root = tmp_path / "cases"

    def load(case: Path) -> None:
        read_peft_adapter(case, cfg, name="x", max_rank=64, root=root)  # as a runtime load reads it: inside a root

    outcomes = run_cases(path, cases, root, load, AdapterError)
    assert outcomes["loaded"] >= 1 and outcomes["refused"] >= len(cases) // 2, outcomes


def test_the_cases_add_up_to_more_than_200(hf_dir, adapter_base):
    """The issue's target row: at least 200 generated cases across the formats, no two the same file."""
    files = {name: (hf_dir / name).read_bytes() for name in ("config.json", "model.safetensors", "tokenizer.json",
                                                              "tokenizer_config.json")}
    adapter = [(adapter_base[0] / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")]
    counts = {"gguf": gguf_cases(random.Random(SEED)), "config": config_cases(files["config.json"], random.Random(1)),
              "safetensors": safetensors_cases("model.safetensors", files["model.safetensors"], random.Random(1)),
              "tokenizer": tokenizer_cases(files["tokenizer.json"], files["tokenizer_config.json"], random.Random(1)),
              "adapter": adapter_cases(*adapter, random.Random(1))}
    for kind, cases in counts.items():
        assert len({(filename, data) for _, filename, data in cases}) == len(cases), kind
    assert sum(map(len, counts.values())) >= 200, {k: len(v) for k, v in counts.items()}


# -- the real server's adapter load route -------------------------------------------------------------------------

KEYS = {"team-a": "sk-fuzz-team-a-0123456789", "team-b": "sk-fuzz-team-b-0123456789", "ops": "sk-fuzz-ops-0123456789"}


def bad_adapters(loras: Path, cfg: Any) -> dict[str, str]:
    """Adapters under --lora-dir, each broken one way: name -> what the refusal names."""
    def adapter(name: str, edit: Callable[[Path], None]) -> None:
        write_random_adapter(loras / name, cfg, rank=4, target_modules=("q_proj",))
        edit(loras / name)

    config, weights = "adapter_config.json", "adapter_model.safetensors"
    adapter("nested", lambda d: bf.with_nested_field(d / config))  # the probe's 500 (RecursionError)
    adapter("pattern", lambda d: (d / config).write_text(json.dumps(
        json.loads((d / config).read_text()) | {"rank_pattern": {"(": 2}})))
    adapter("rank-zero", lambda d: (d / config).write_text(json.dumps(json.loads((d / config).read_text()) | {"r": 0})))
    adapter("not-an-object", lambda d: (d / config).write_text("[]"))
    adapter("truncated", lambda d: (d / weights).write_bytes((d / weights).read_bytes()[:100]))
    adapter("huge-header", lambda d: (d / weights).write_bytes(struct.pack("<Q", 2**63)
                                                               + (d / weights).read_bytes()[8:]))
    adapter("good", lambda d: None)
    return {"nested": config, "pattern": config, "rank-zero": config, "not-an-object": config, "truncated": weights,
            "huge-header": weights}


def test_bad_adapters_through_the_load_route_are_400_and_the_server_serves_on(hf_dir, tmp_path):
    """What a key holder sends the route: each broken adapter is a 400 in the OpenAI error shape naming the file (the
    probe's nested adapter_config.json was a 500), and the server answers the next request and loads a good one.
    The admin key loads them: who may load which directory is finding 5's, not this one's."""
    loras = tmp_path / "loras"
    expected = bad_adapters(loras, read_model_config(hf_dir))
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + "".join(f"  - {{name: {n}, key: {k}{', role: admin' if n == 'ops' else ''}}}\n"
                                        for n, k in KEYS.items()))
    with running_server("--model", str(hf_dir), "--api-key-file", str(keys), "--enable-lora", "--max-lora-rank", "8",
                        "--allow-runtime-lora-updating", "--lora-dir", str(loras), "--num-kv-blocks", "64",
                        headers={"Authorization": f"Bearer {KEYS['ops']}"}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["ops"], max_retries=0, timeout=60)
        for name, filename in expected.items():
            with pytest.raises(openai.BadRequestError) as e:
                client.post("/load_lora_adapter", cast_to=object,
                            body={"lora_name": f"bad-{name}", "lora_path": str(loras / name)})
            error = e.value.body
            assert error["param"] == "lora_path" and error["type"] == "invalid_request_error", (name, error)
            assert filename in error["message"] and "\n" not in error["message"], (name, error)
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert client.post("/load_lora_adapter", cast_to=object,
                           body={"lora_name": "good", "lora_path": str(loras / "good")})["id"] == "good"
        team_b = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["team-b"], max_retries=0, timeout=60)
        # ignore_eos: the random-weight model samples its EOS now and then, and 2 tokens are what this counts
        out = team_b.completions.create(model=client.models.list().data[0].id, prompt="w1 w2", max_tokens=2,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 2
