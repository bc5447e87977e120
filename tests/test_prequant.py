"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) on the packed int kernels (loader/prequant.py).

Unit tests: the exact mapping of integer codes onto the kernel layouts (layers/formats/int_weights.py), each packing read
back, the refusals. Then real checkpoints made here, offline: llm-compressor one-shots (GPTQ W4A16 groups of 128,
AWQ W4A16 with zero points in groups of 32, GPTQ W8A16, W8A8 int8, FP8 dynamic) of a tiny random Llama with
calibration tokens made in the test, and the GPTQ (v1, v2) and AWQ packings of the same integer codes; lmserve's
logits and greedy tokens against the library's own dequantized model."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.layers.formats.gguf_linear import S8, U4, GGUFLinear, dequantize, quantize_activations, reference_linear
from lmserve.layers.formats.int_weights import IntWeights, dequantize_int, kernel_blocks
from lmserve.loader import load_model, read_model_config
from lmserve.loader.prequant import read_scheme
from lmserve.loader.prequant_formats import read_awq, read_compressed_int, read_gptq
from lmserve.worker.transforms import load_formatted
from tests.prequant_writers import HIDDEN, LAYERS, VOCAB, pack_awq, pack_rows, write_packed, write_tiny_base

CPU = torch.device("cpu")
PARITY = 1e-5  # float32 summation order only
# The int kernels against the library's model with the kernels' activation rounding: the ~1e-6 differences between
# two float models move a few activations across a rounding boundary (one int8 step each); measured 4.5e-3
FLIPS = 1e-2


def random_int_weights(n: int, k: int, bits: int, group: int, symmetric: bool, seed: int = 0) -> IntWeights:
    """Random codes, float16-valued scales (as real checkpoints hold them), zeros in the codes' range."""
    rng = np.random.default_rng(seed)
    g = k // group
    scales = rng.uniform(0.002, 0.03, size=(n, g)).astype(np.float16).astype(np.float32)
    zeros = (np.full((n, g), 1 << (bits - 1)) if symmetric else rng.integers(0, 1 << bits, size=(n, g)))
    return IntWeights(rng.integers(0, 1 << bits, size=(n, k), dtype=np.uint8), scales, zeros.astype(np.int16), bits)


@pytest.mark.parametrize("bits,group,symmetric,k", [(4, 32, True, 1056), (4, 32, False, 1056), (4, 128, False, 1152),
                                                    (4, 1152, True, 1152), (8, 128, True, 1152), (8, 32, True, 1056)])
@pytest.mark.parametrize("n", [37, 48])  # odd rows (the row layout); whole groups of 16 (packed on AVX-512 VNNI)
def test_codes_map_exactly_onto_the_kernel_layouts(bits, group, symmetric, k, n):
    """U4 for 4 bits (a group of 128 is four blocks with one scale and min), S8 for symmetric 8 bits: the dequantized
    numbers are the checkpoint's own, bit for bit; the kernel equals the dequantize-then-matmul reference."""
    w = random_int_weights(n, k, bits, group, symmetric)
    blocks = kernel_blocks(w)
    assert blocks.kind == (U4 if bits == 4 else S8)
    assert torch.equal(dequantize(blocks), dequantize_int(w))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    out, ref = GGUFLinear(blocks, k, bias)(x), reference_linear(x, blocks, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_no_layout_fits_zero_points_on_8_bits_or_groups_under_32():
    assert kernel_blocks(random_int_weights(16, 256, 8, 128, symmetric=False)) is None
    assert kernel_blocks(random_int_weights(16, 256, 4, 16, symmetric=True)) is None


class Dict(dict):
    """A dict of named tensors, as a checkpoint's tensors."""

    def get(self, name):  # type: ignore[override]
        return self[name]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_packing_read_back(bits, v1):
    w = random_int_weights(48, 256, bits, 64, symmetric=False)
    stored = (w.zeros - 1) % (1 << bits) if v1 else w.zeros
    t = Dict({"l.qweight": torch.from_numpy(pack_rows(w.codes.T, bits)),
              "l.scales": torch.from_numpy(w.scales.T.copy()),
              "l.qzeros": torch.from_numpy(np.ascontiguousarray(pack_rows(stored, bits).T)),
              "l.g_idx": torch.arange(256, dtype=torch.int32) // 64})
    got = read_gptq(t, "l", bits, v1)
    assert np.array_equal(got.codes, w.codes) and np.array_equal(got.zeros, w.zeros)
    assert np.array_equal(got.scales, w.scales)
    t["l.g_idx"] = torch.from_numpy(np.random.default_rng(0).permutation(256).astype(np.int32) // 64)
    with pytest.raises(CheckpointError, match="l.g_idx: input columns are not in group order"):
        read_gptq(t, "l", bits, v1)


def test_awq_packing_read_back():
    w = random_int_weights(48, 256, 4, 32, symmetric=False)
    t = Dict({"l.qweight": torch.from_numpy(pack_awq(w.codes.T)), "l.qzeros": torch.from_numpy(pack_awq(w.zeros.T)),
              "l.scales": torch.from_numpy(w.scales.T.copy())})
    got = read_awq(t, "l")
    assert np.array_equal(got.codes, w.codes) and np.array_equal(got.zeros, w.zeros)


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_packing_read_back(bits):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    w = random_int_weights(40, 256, bits, 128, symmetric=False)
    offset = 1 << (bits - 1)
    signed = lambda a: torch.from_numpy(a.astype(np.int16) - offset).to(torch.int8)  # noqa: E731
    t = Dict({"l.weight_packed": helpers.pack_to_int32(signed(w.codes), bits),
              "l.weight_shape": torch.tensor([40, 256]), "l.weight_scale": torch.from_numpy(w.scales),
              "l.weight_zero_point": helpers.pack_to_int32(signed(w.zeros), bits, packed_dim=0)})
    got = read_compressed_int(t, "l")
    assert np.array_equal(got.codes, w.codes) and np.array_equal(got.zeros, w.zeros) and got.bits == bits


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT_GROUP = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": CT_GROUP}}


@pytest.mark.parametrize("q,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method = 'bitsandbytes': not loaded"),
    (GPTQ | {"bits": 3}, "bits = 3: GPTQ runs with 4- or 8-bit codes"),
    (GPTQ | {"group_size": 64 + 16}, "group_size = 80: groups must be a multiple of 32"),
    (GPTQ | {"desc_act": True}, "desc_act = True: act-order"),
    (GPTQ | {"checkpoint_format": "marlin"}, "checkpoint_format = 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version = 'gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits = 8: AWQ runs with 4-bit codes"),
    (CT | {"format": "nvfp4-pack-quantized"}, "format = 'nvfp4-pack-quantized': not loaded"),
    (CT | {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
    (CT | {"config_groups": {"g": {"weights": CT_GROUP["weights"] | {"num_bits": 2}}}},
     "config_groups.g.weights.num_bits = 2"),
    (CT | {"config_groups": {"g": {"weights": CT_GROUP["weights"] | {"actorder": "group"}}}},
     "config_groups.g.weights.actorder = 'group'"),
    (CT | {"config_groups": {"g": {"weights": CT_GROUP["weights"] | {"group_size": 16}}}},
     "config_groups.g.weights.group_size = 16"),
])
def test_refused_with_the_field_and_its_value(q, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        read_scheme({"quantization_config": q})


def test_accepted_schemes():
    assert read_scheme({}) is None
    assert read_scheme({"quantization_config": GPTQ}).summary == "gptq 4-bit g128 sym"
    v2 = read_scheme({"quantization_config": GPTQ | {"group_size": -1, "checkpoint_format": "gptq_v2"}})
    assert v2.gptq_v1 is False and v2.summary == "gptq 4-bit per row sym"
    ct = read_scheme({"quantization_config": CT})
    assert ct.summary == "compressed-tensors pack-quantized w4 group128 sym" and not ct.all_fp8


# ---- real checkpoints: llm-compressor one-shots on CPU, and the GPTQ / AWQ packings of their codes ----

@dataclass
class Greedy:
    """Greedy continuations of PROMPTS and, at each step, the gap between the two best logits."""

    tokens: list[list[int]]
    margins: list[list[float]]


@dataclass
class Reference:
    """A checkpoint and what the quantizing library's own dequantized model says about it."""

    path: Path
    logits: torch.Tensor  # [T, vocab] for PROMPTS[0]
    greedy: Greedy | None  # where an engine test compares with it
    # the same with each quantized linear's input rounded as the int kernels round it (None: no int kernel runs)
    rounded: torch.Tensor | None
    rounded_greedy: Greedy | None  # likewise
    kind: int | None  # the kernel layout its projections get (None: dequantized to float)


PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(7 + n)).tolist() for n in (40, 9, 25)]
GREEDY_TOKENS = 12


def round_like_the_kernels(model: nn.Module) -> list:
    """Hooks that quantize each projection's input per 32 values to int8 as quant_gemm.cpp does (not the LM head)."""
    def hook(module, args):
        x = args[0]
        q, s = quantize_activations(x.reshape(-1, x.shape[-1]))
        return ((q.view(q.shape[0], -1, 32) * s[..., None]).view(x.shape),) + args[1:]

    return [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name != "lm_head"]


def generate(model: nn.Module) -> Greedy:
    """transformers' own greedy search over PROMPTS, with the logits' top-2 gap of each step."""
    out = Greedy([], [])
    model.generation_config.eos_token_id = None  # run all the steps, as the engine's ignore_eos does
    for prompt in PROMPTS:
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False, num_beams=1,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        out.tokens.append(gen.sequences[0, len(prompt):].tolist())
        out.margins.append([float(-torch.diff(step[0].topk(2).values)) for step in gen.logits])
    return out


def library_view(model: nn.Module, path: Path, kind: int | None, greedy: str) -> Reference:
    """Logits of the library's model, as it is and with the kernels' activation rounding; greedy tokens of the
    variants named in `greedy` ("plain", "rounded": what the engine tests compare with)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0].clone()
        plain = generate(model) if "plain" in greedy else None
        if kind is None:
            return Reference(path, logits, plain, None, None, kind)
        hooks = round_like_the_kernels(model)
        rounded = model(torch.tensor([PROMPTS[0]])).logits[0].clone()
        rounded_greedy = generate(model) if "rounded" in greedy else None
        for h in hooks:
            h.remove()
    return Reference(path, logits, plain, rounded, rounded_greedy, kind)


def agree_until_a_near_tie(ours: list[list[int]], ref: Greedy, margin: float) -> int:
    """Each continuation equals the reference's up to its first step whose two best logits are within `margin`
    (where a difference in rounding may pick either); returns how many tokens were compared."""
    compared = 0
    for got, want, gaps in zip(ours, ref.tokens, ref.margins):
        n = next((i for i, gap in enumerate(gaps) if gap < margin), len(gaps))
        assert got[:n] == want[:n], (got, want, gaps)
        compared += n
    return compared


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Reference]:
    """Five one-shots of one tiny random Llama (GPTQ and AWQ ~10-20 s each on a loaded 2-core CPU, the data-free
    W8A8 and FP8 under a second) and four re-packings."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    root = tmp_path_factory.mktemp("prequant")
    base = write_tiny_base(root / "base")
    tok = AutoTokenizer.from_pretrained(base)
    g = torch.Generator().manual_seed(1)
    calibration = Dataset.from_dict({"input_ids": [torch.randint(0, VOCAB, (32,), generator=g).tolist()
                                                   for _ in range(8)], "attention_mask": [[1] * 32] * 8})
    awq_g32 = {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32))}
    recipes = {  # name: (recipe, kernel layout, which greedy references the engine tests need)
        "ct-gptq-w4g128": (GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]), U4, "rounded"),
        "ct-awq-w4g32": (AWQModifier(config_groups=awq_g32, ignore=["lm_head"], n_grid=4), U4,  # grid: 20 -> 4
                         "plain rounded"),
        "ct-gptq-w8": (GPTQModifier(targets="Linear", scheme="W8A16", ignore=["lm_head"]), S8, "rounded"),
        "ct-w8a8-int8": (QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]), S8, ""),
        "ct-fp8": (QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]), None, "")}
    refs = {}
    for name, (recipe, kind, greedy) in recipes.items():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with pytest.MonkeyPatch.context() as mp:
            # AWQ pins its cached activations for copies to an accelerator, which fails without one: a no-op on CPU
            mp.setattr(IntermediatesCache, "pin_memory", lambda self, *args, **kwargs: None)
            oneshot(model=model, processor=tok, dataset=calibration, recipe=recipe, num_calibration_samples=8,
                    max_seq_length=32)
        model.save_pretrained(root / name, save_compressed=True)
        tok.save_pretrained(root / name)
        if name in ("ct-w8a8-int8", "ct-fp8"):  # W8A8: the library's model also rounds activations (per token, to
            # int8 or FP8); lmserve's weights are the same, its activations float or rounded per 32 by the kernels
            model = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32,
                                                         quantization_config=CompressedTensorsConfig(dequantize=True))
        refs[name] = library_view(model.eval(), root / name, kind, greedy)
    for name, src, method, v1 in (("gptq-v1-w4g128", "ct-gptq-w4g128", "gptq", True),
                                  ("gptq-v2-w4g128", "ct-gptq-w4g128", "gptq", False),
                                  ("gptq-v1-w4g32-zp", "ct-awq-w4g32", "gptq", True),
                                  ("awq-w4g32", "ct-awq-w4g32", "awq", True)):
        refs[name] = replace(refs[src], path=write_packed(root / src, root / name, method, v1))
    return refs


NAMES = ["ct-gptq-w4g128", "ct-awq-w4g32", "ct-gptq-w8", "ct-w8a8-int8", "ct-fp8", "gptq-v1-w4g128",
         "gptq-v2-w4g128", "gptq-v1-w4g32-zp", "awq-w4g32"]
PROJECTION_WEIGHTS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def logits_of(model: nn.Module) -> torch.Tensor:
    ids = torch.tensor(PROMPTS[0])
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), ContiguousAttention([len(ids)])))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", NAMES)
def test_float_path_equals_the_librarys_dequantized_model(checkpoints, name):
    """--quantization none: every quantized layer dequantized at load, (code - zero) * scale: the plain reference."""
    ref = checkpoints[name]
    loaded = load_formatted(ref.path, torch.float32, CPU, quantization="none")
    assert loaded.weight_format == "none" and not any(isinstance(m, GGUFLinear) for m in loaded.model.modules())
    assert rel(logits_of(loaded.model), ref.logits) <= PARITY


@pytest.mark.parametrize("name", NAMES)
def test_int_kernels_run_the_checkpoints_own_codes(checkpoints, name):
    """--quantization auto on CPU/float32: every projection a GGUFLinear over the checkpoint's codes (no float copy of
    them), logits equal to the library's model with the kernels' int8 activation rounding; FP8 stays float."""
    ref = checkpoints[name]
    loaded = load_formatted(ref.path, torch.float32, CPU, quantization="auto")
    kept = [m for m in loaded.model.modules() if isinstance(m, GGUFLinear)]
    if ref.kind is None:
        assert loaded.weight_format == "none" and not kept and "fp8" in loaded.quantization
        assert rel(logits_of(loaded.model), ref.logits) <= PARITY
        return
    assert loaded.keeps_blocks and loaded.weight_format == json.loads(
        (ref.path / "config.json").read_text())["quantization_config"]["quant_method"]
    assert len(kept) == 4 * LAYERS and {m.kind for m in kept} == {ref.kind}
    held = [n for n, _ in [*loaded.model.named_parameters(), *loaded.model.named_buffers()]]
    assert not [n for n in held if n.endswith(PROJECTION_WEIGHTS)], "a float copy of quantized weights was kept"
    # a float32 checkpoint's table stays float32 (held in the checkpoint's dtype: never narrowed)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32
    # each kept layer against the float path's weight for it (the checkpoint dequantized: (code - zero) * scale),
    # its input rounded as the kernel rounds it: one matmul, so float32 summation order is the only difference
    plain = load_model(ref.path, torch.float32, CPU, quantization="none").model
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3))
    for name, layer in loaded.model.named_modules():
        if isinstance(layer, GGUFLinear) and layer.in_features == HIDDEN:
            q, s = quantize_activations(x)
            want = (q.view(7, -1, 32) * s[..., None]).view(7, -1) @ plain.get_submodule(name).weight.T
            assert rel(layer(x), want) <= PARITY
    # the whole model: every layer's rounding as above, then ~1e-7 differences between two float models move a few
    # activations across a rounding boundary (one int8 step each): FLIPS
    ours = logits_of(loaded.model)
    round_like_the_kernels(plain)
    assert rel(ours, logits_of(plain)) <= FLIPS
    assert rel(ours, ref.rounded) <= FLIPS
    assert rel(ours, ref.logits) <= 0.1  # the rounding itself: int8 activations per 32 values, as llama.cpp's


def engine_greedy(path: Path, quantization: str) -> tuple[list[list[int]], list[list[int]], object]:
    """Greedy continuations of PROMPTS through the engine (paged KV, the native decode stack), each alone and then
    all in one batch (prefix caching off: the batch recomputes every prompt)."""
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.sampling_params import SamplingParams
    from tests.test_engine import assert_no_leak, run

    eng = LLMEngine(EngineConfig(model=str(path), quantization=quantization, dtype="float32",
                                 cache=CacheConfig(num_blocks=64, enable_prefix_caching=False)))
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    alone = [run(eng, [p], params)["0"]["ids"] for p in PROMPTS]
    together = run(eng, PROMPTS, params)
    assert_no_leak(eng)
    return alone, [together[str(i)]["ids"] for i in range(len(PROMPTS))], eng.loaded


@pytest.mark.parametrize("name", ["gptq-v1-w4g128", "ct-awq-w4g32", "ct-gptq-w8"])
def test_engine_greedy_on_the_int_kernels(checkpoints, name):
    """The library's greedy tokens under the kernels' rounding, up to a near tie; a batch gives each request's
    tokens alone exactly (the kernels are batch invariant); no KV block leaks."""
    ref = checkpoints[name]
    alone, together, loaded = engine_greedy(ref.path, "auto")
    assert loaded.keeps_blocks and together == alone
    # margin: twice the largest logit change the rounding flips made in test_int_kernels_run_the_checkpoints_own_codes
    # (~0.015; a random tiny model has many near ties, so at least 8 of the 36 tokens must be compared)
    assert agree_until_a_near_tie(alone, ref.rounded_greedy, margin=0.03) >= 8


def test_engine_greedy_on_the_float_path(checkpoints):
    """--quantization none: the library's own greedy tokens (float32 order differences only: near ties of 1e-4)."""
    ref = checkpoints["awq-w4g32"]
    alone, together, loaded = engine_greedy(ref.path, "none")
    assert not loaded.keeps_blocks and together == alone
    assert agree_until_a_near_tie(alone, ref.greedy, margin=1e-4) >= 2 * GREEDY_TOKENS


@pytest.fixture(scope="module")
def bf16_tied(tmp_path_factory) -> Reference:
    """llm-compressor's data-free W4A16 (groups of 32) of the tiny Llama made in bfloat16 with a tied table, as
    SmolLM2 ships: the unquantized table stays bfloat16 in the checkpoint. Reference: the library's own dequantized
    model in float32 (the bf16 table widened exactly)."""
    pytest.importorskip("llmcompressor")
    import shutil

    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    root = tmp_path_factory.mktemp("prequant-bf16")
    base = write_tiny_base(root / "base", torch.bfloat16, tied=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, symmetric=True, strategy="group", group_size=32))}
    oneshot(model=model, recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
    model.save_pretrained(root / "w4a16", save_compressed=True)
    # The library dequantizes code * scale in the scales' dtype: bf16 here, one rounding of every weight that
    # lmserve (float32 scales, exact products) does not make (~7e-3 in the logits). Its model is read from a copy
    # with the scales widened (exact) so that only the head's handling differs.
    shutil.copytree(root / "w4a16", root / "library")
    tensors = load_file(str(root / "library" / "model.safetensors"))
    save_file({k: t.float() if k.endswith("weight_scale") else t for k, t in tensors.items()},
              str(root / "library" / "model.safetensors"), metadata={"format": "pt"})
    lib = AutoModelForCausalLM.from_pretrained(root / "library", dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True))
    return library_view(lib.eval(), root / "w4a16", U4, "")


def test_a_bf16_head_is_held_in_bf16(bf16_tied):
    """The table the checkpoint stores in bfloat16 keeps its values, held once (the tied embedding looks its rows up
    in the head), coded losslessly in 12 bits a weight and read by the coded half kernel; no float32 or second copy
    of it is kept. Logits: the library's dequantized model's, as for the float32 checkpoints (the bf16 -> float32
    widening is exact)."""
    from safetensors import safe_open

    from lmserve.layers.formats.half_linear import HalfEmbedding, HalfLinear

    with safe_open(str(bf16_tied.path / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
        table = f.get_tensor("model.embed_tokens.weight")
    loaded = load_formatted(bf16_tied.path, torch.float32, CPU, quantization="auto")
    head, embed = loaded.model.lm_head, loaded.model.model.embed_tokens
    assert isinstance(head, HalfLinear) and isinstance(embed, HalfEmbedding)
    assert head.coded is not None and embed.head_rows.__self__ is head
    assert torch.equal(head.half_rows().view(torch.int16), table.view(torch.int16))  # lossless
    held = [t for t in [*loaded.model.parameters(), *loaded.model.buffers()]
            if t.is_floating_point() and t.numel() >= VOCAB * HIDDEN]
    assert held == [] and head.codes.dtype == torch.uint8 and head.codes.nbytes <= 0.8 * 2 * VOCAB * HIDDEN
    ours = logits_of(loaded.model)
    assert rel(ours, bf16_tied.rounded) <= FLIPS
    assert rel(ours, bf16_tied.logits) <= 0.1  # the int8 activation rounding itself
    plain = load_formatted(bf16_tied.path, torch.float32, CPU, quantization="none").model  # float path: widened
    assert plain.model.embed_tokens.weight.dtype == torch.float32 and rel(logits_of(plain), bf16_tied.logits) <= PARITY


def test_refused_checkpoint_fails_before_loading(checkpoints, tmp_path):
    import shutil

    path = shutil.copytree(checkpoints["gptq-v1-w4g128"].path, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (path / "config.json").write_text(json.dumps(config))
    for load in (read_model_config, lambda p: load_formatted(p, torch.float32, CPU)):
        with pytest.raises(CheckpointError, match=r"config.json: quantization_config.desc_act = True: act-order"):
            load(path)
