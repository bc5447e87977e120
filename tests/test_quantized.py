"""Weight-only int8/int4: exact kernel formula, the GGUF's own Q4_1 codes kept, the engine on quantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lmserve.config import CacheConfig, EngineConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.layers.formats.quantized import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
    quantize_linears,
)
from lmserve.sampling_params import SamplingParams
from lmserve.worker.transforms import load_formatted
from tests.conftest import save_tiny_hf
from tests.test_model_parity import flat_logits

BF16 = torch.bfloat16
TEXT = ("The quick brown fox jumps over the lazy dog while the sun sets behind distant hills and rivers carry "
        "stories of old towns, markets, bridges and songs to the patient sea. Paris is the capital of France, "
        "and Berlin is the capital of Germany.")

MORE_TEXTS = (
    "The history of the lighthouse begins in ancient Alexandria, where the Pharos guided ships into the harbour "
    "for centuries. Modern lighthouses use lenses invented by Augustin Fresnel, which focus the light into a beam "
    "visible for many miles. Keepers once lived in the towers, trimming wicks and winding clockwork; today most "
    "lights are automated and monitored remotely.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n# The sequence grows quickly; each number is the sum of the two "
    "before it.")


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).float()


def test_int4_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.linspace(0.01, 3, 96)  # columns of very different ranges
    w[5, :32] = 0.25  # a constant group (scale 0) must come back exactly
    codes, scale, lo = quantize_int4(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scale.shape == (48, 3)
    err = (dequantize_int4(codes, scale, lo) - w).abs().reshape(48, 3, 32)
    assert torch.all(err <= scale[..., None] / 2 + 1e-6)
    assert torch.equal(dequantize_int4(codes, scale, lo)[5, :32], w[5, :32])


@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_computes_the_documented_formula(bias):
    """The packed kernel equals x_bf16 @ ((q - 8) * scale + zero)^T with bf16 scale and zero, to float rounding."""
    torch.manual_seed(1)
    lin = nn.Linear(96, 64, bias=bias)
    layer = Int4Linear(lin)
    codes, scale, lo = quantize_int4(lin.weight.detach())
    s, z = bf16(scale), bf16(lo + 8 * scale)
    w = ((codes.float() - 8).reshape(64, 3, 32) * s[..., None] + z[..., None]).reshape(64, 96)
    x = torch.randn(5, 7, 96)
    ref = bf16(x) @ w.T + (lin.bias.detach() if bias else 0)
    out = layer(x)
    assert out.shape == (5, 7, 64) and out.dtype == torch.float32
    # the kernel returns bf16: the only difference left is that final rounding
    assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    # and the dequantized weights are close to the float ones (int4 error, not a formula slip)
    assert (w - lin.weight.detach()).abs().max() <= scale.max() * 0.51 + bf16(lo + 8 * scale).abs().max() * 2 ** -8


def test_int8_linear_computes_the_documented_formula():
    torch.manual_seed(2)
    lin = nn.Linear(80, 48)
    layer = Int8Linear(lin)
    q, scale = quantize_int8(lin.weight.detach())
    assert (q.float() * scale[:, None] - lin.weight.detach()).abs().max() <= scale.max() / 2 + 1e-7
    x = torch.randn(9, 80)
    ref = bf16(x) @ (q.float() * bf16(scale)[:, None]).T + lin.bias.detach()
    assert torch.allclose(layer(x), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_quantized_rows_do_not_depend_on_the_batch():
    """A row's result is the same alone or among 40 (what keeps greedy output batch-invariant)."""
    torch.manual_seed(3)
    for layer in (Int4Linear(nn.Linear(576, 1536, bias=False)), Int8Linear(nn.Linear(576, 1536, bias=False))):
        x = torch.randn(40, 576)
        full = layer(x)
        assert torch.equal(full, torch.cat([layer(x[i:i + 1]) for i in range(40)]))


def q4_1_codes(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The 4-bit codes stored in a GGUF Q4_1 tensor (blocks of 32: f16 d, f16 m, 16 bytes of nibbles)."""
    blocks = raw.reshape(-1, 20)[:, 4:]
    codes = np.concatenate([blocks & 0x0F, blocks >> 4], axis=1)  # low nibbles are elements 0-15
    return codes.reshape(rows, cols)


def test_int4_keeps_the_gguf_q4_1_codes(smol_path):
    """Requantizing the dequantized Q4_1 weights gives back exactly the file's codes, and the same values."""
    from lmserve.loader.gguf_file import read_gguf
    from lmserve.loader.gguf_loader import _dequantize

    f = read_gguf(smol_path)
    checked = 0
    for t in f.tensors:
        if t.ggml_type != 3 or not t.name.startswith(("blk.0.", "blk.29.")):  # 3 = Q4_1
            continue
        rows, cols = t.shape
        w = _dequantize(t, f.path)
        codes, scale, lo = quantize_int4(w)
        assert np.array_equal(codes.numpy(), q4_1_codes(t.data, rows, cols)), t.name
        assert torch.allclose(dequantize_int4(codes, scale, lo), w, rtol=0, atol=1e-6 * w.abs().max().item())
        checked += 1
    assert checked == 14


@pytest.fixture(scope="module")
def smol_fp32(smol_path):
    return load_formatted(smol_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantized_embedded_model_stays_close_to_float(smol_path, smol_fp32, scheme):
    quant = load_formatted(smol_path, torch.float32, torch.device("cpu"), quantization=scheme)
    assert quant.runtime_quantization == scheme
    layer = quant.model.model.layers[0]
    expected = Int4Linear if scheme == "int4" else Int8Linear
    assert isinstance(layer.self_attn.qkv_proj, expected) and isinstance(layer.mlp.down_proj, expected)
    assert isinstance(quant.model.lm_head, Int8Linear)
    assert quant.model.model.embed_tokens.weight.dtype == torch.float32  # lookups stay exact
    from lmserve.tokenizer import load_tokenizer

    # Three texts (193 positions): on one 49-token text a single near-tie flipping moved the rate by 2%,
    # and one more flip on a fresh machine (same torch) took int8 from 0.96 to 0.94 at the base commit.
    tok = load_tokenizer(smol_fp32)
    prompts = [tok.encode(t) for t in (TEXT, *MORE_TEXTS)]
    ref = torch.cat(flat_logits(smol_fp32.model, prompts))
    out = torch.cat(flat_logits(quant.model, prompts))
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1).min().item()
    # int4 is the file's own grid (only bf16 activations/scales differ), int8 a re-rounding of it
    # (measured on this fixed set, AMD EPYC Zen 3: int4 0.974, int8 0.959)
    assert agree >= 0.95 and cos >= 0.98, (agree, cos)


def test_tiny_model_keeps_unsupported_shapes_in_float(tmp_path):
    """intermediate 112 is not a multiple of the int4 group: down_proj stays a float layer, the rest is int4."""
    path, _ = save_tiny_hf(tmp_path, "qwen2")
    loaded = load_formatted(path, torch.float32, torch.device("cpu"), quantization="int4")
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and layer.self_attn.qkv_proj.bias is not None
    assert type(layer.mlp.down_proj) is nn.Linear
    logits = flat_logits(loaded.model, [[1, 2, 3, 4]])[0]
    assert torch.isfinite(logits).all()


def test_unknown_scheme_and_gpu_device_are_refused(smol_path):
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        load_formatted(smol_path, torch.float32, torch.device("cpu"), quantization="int3")
    with pytest.raises(ValueError, match="runs on CPU or CUDA, not on meta"):
        load_formatted(smol_path, torch.float32, torch.device("meta"), quantization="int4")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(nn.Sequential(nn.Linear(32, 16)), "fp8")


def test_int4_engine_batch_equals_alone_and_frees_blocks():
    """The engine on int4 weights: greedy output of each request alone == inside a batch, no block leaked."""
    eng = LLMEngine(EngineConfig(quantization="int4", cache=CacheConfig(num_blocks=256)))
    prompts = ["The capital of France is", "Write one sentence about rivers and the sea, please.", "1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def run(ps):
        for i, p in enumerate(ps):
            eng.add_request(str(i), eng.front.tokenize_prompt(p), params)
        out: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        return out

    alone = [run([p])["0"] for p in prompts]
    batched = run(prompts)
    assert [batched[str(i)] for i in range(3)] == alone
    assert all(len(ids) == 12 or ids[-1] in eng.eos_token_ids for ids in alone)
    assert eng.kv.num_free_blocks == eng.num_blocks
    assert "Paris" in eng.tokenizer.decode(alone[0])
