"""Test helpers (not a test module): a tiny GGUF model written byte by byte (so any field can be given any type or
value, as no writer would) and JSON nested past any parser's recursion, for the malformed files of issue 47
(tests/test_file_fuzz.py feeds them to the loaders, tests/test_cli_errors.py to `lmserve serve`)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np

# GGUF value types (gguf's GGUFValueType)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
            I64: "<q", F64: "<d"}
F32_TYPE, F16_TYPE, Q8_0_TYPE = 0, 1, 8  # ggml tensor types

# The tiny Llama: 1 layer, hidden 32, 2 heads of 16 (1 KV head), MLP 64, a 32-token byte-level BPE vocabulary
HIDDEN, HEADS, KV_HEADS, FFN, CONTEXT = 32, 2, 1, 64, 64
TOKENS = ["<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "cd", "abcd", "Ġ"]
ISSUE_NESTING = 200_000  # how deep the probe nested its arrays


def gguf_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(vtype: int, value: Any) -> bytes:
    """A value's bytes (no type tag); an array is (item type, items)."""
    if vtype == STR:
        return gguf_string(value)
    if vtype == ARR:
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(gguf_value(item_type, v) for v in items)
    return struct.pack(_FORMATS[vtype], value)


def nested_gguf_array(depth: int) -> bytes:
    """A metadata value (type tag included): arrays of arrays `depth` deep around an empty array of u8."""
    return struct.pack("<I", ARR) + struct.pack("<IQ", ARR, 1) * (depth - 1) + struct.pack("<IQ", U8, 0)


# metadata key -> (type, value), or raw bytes (type tag + value) for what (type, value) cannot say
Meta = dict[str, "tuple[int, Any] | bytes"]
Tensor = tuple[str, tuple[int, ...], int, bytes]  # name, dims (GGUF order: fastest first), ggml type, data


def gguf_bytes(meta: Meta, tensors: list[Tensor], alignment: int = 32, version: int = 3) -> bytes:
    """A GGUF file: header, metadata, tensor infos, then each tensor's data at its aligned offset."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(meta))
    for key, v in meta.items():
        out += gguf_string(key) + (v if isinstance(v, bytes) else struct.pack("<I", v[0]) + gguf_value(*v))
    data, offset = b"", 0
    for name, dims, ggml_type, raw in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ggml_type, offset)
        pad = -len(raw) % alignment
        data += raw + b"\0" * pad
        offset += len(raw) + pad
    return out + b"\0" * (-len(out) % alignment) + data


def tiny_meta() -> Meta:
    """The tiny Llama's metadata, as llama.cpp's converter writes it (types included)."""
    arch = "llama"
    return {
        "general.architecture": (STR, arch), "general.alignment": (U32, 32), "general.file_type": (U32, 0),
        f"{arch}.context_length": (U32, CONTEXT), f"{arch}.embedding_length": (U32, HIDDEN),
        f"{arch}.feed_forward_length": (U32, FFN), f"{arch}.block_count": (U32, 1),
        f"{arch}.attention.head_count": (U32, HEADS), f"{arch}.attention.head_count_kv": (U32, KV_HEADS),
        f"{arch}.attention.layer_norm_rms_epsilon": (F32, 1e-5), f"{arch}.rope.freq_base": (F32, 10000.0),
        "tokenizer.ggml.model": (STR, "gpt2"), "tokenizer.ggml.pre": (STR, "default"),
        "tokenizer.ggml.tokens": (ARR, (STR, TOKENS)),
        "tokenizer.ggml.token_type": (ARR, (I32, [3, 3] + [1] * (len(TOKENS) - 2))),
        "tokenizer.ggml.merges": (ARR, (STR, ["a b", "c d", "ab cd"])),
        "tokenizer.ggml.bos_token_id": (U32, 0), "tokenizer.ggml.eos_token_id": (U32, 1),
    }


def tiny_tensors(seed: int = 0) -> list[Tensor]:
    """The tiny Llama's weights (F32, the LM head F16, one Q8_0 projection), HF [rows, cols] written GGUF-reversed."""
    import gguf

    g = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (len(TOKENS), HIDDEN), "blk.0.attn_norm.weight": (HIDDEN,),
              "blk.0.ffn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HEADS * head_dim, HIDDEN),
              "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HEADS * head_dim), "blk.0.ffn_gate.weight": (FFN, HIDDEN),
              "blk.0.ffn_up.weight": (FFN, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    out = []
    for name, shape in shapes.items():
        w = (g.standard_normal(shape) * (0.1 if len(shape) > 1 else 1.0)).astype(np.float32)
        if name == "output.weight":
            out.append((name, shape[::-1], F16_TYPE, w.astype(np.float16).tobytes()))
        elif name == "blk.0.ffn_up.weight":
            blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            out.append((name, shape[::-1], Q8_0_TYPE, blocks.tobytes()))
        else:
            out.append((name, shape[::-1], F32_TYPE, w.tobytes()))
    return out


def write_tiny_gguf(path: Path, edit: Callable[[Meta], None] = lambda meta: None, **kwargs: Any) -> Path:
    """The tiny Llama as a GGUF file, its metadata first changed by `edit` (kwargs: gguf_bytes's)."""
    meta = tiny_meta()
    edit(meta)
    path.write_bytes(gguf_bytes(meta, tiny_tensors(), **kwargs))
    return path


def nested_json(depth: int) -> str:
    """A JSON array nested `depth` deep (json.loads recurses once per level)."""
    return "[" * depth + "]" * depth


def nested_into(text: str, depth: int = ISSUE_NESTING) -> str:
    """The JSON object `text` with a field `nested` added first, an array nested `depth` deep (the probe's deep
    config and tokenizer files)."""
    rest = text.strip()[1:]  # the object's fields and its closing brace
    return '{"nested": ' + nested_json(depth) + ("" if rest.strip() == "}" else ", ") + rest


def with_nested_field(path: Path, depth: int = ISSUE_NESTING) -> None:
    """`nested_into` the JSON object in the file `path`."""
    path.write_text(nested_into(path.read_text(), depth))
