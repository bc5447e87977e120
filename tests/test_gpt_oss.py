"""gpt-oss beyond what every family shares (tests/test_model_families.py runs the tiny gpt_oss there: logits and
greedy tokens against transformers from safetensors and GGUF, windows, prefix caching, chunked prefill): its YaRN
table as the released configs set it, sinks that dominate the softmax, and MXFP4 experts from a GGUF file (ggml's
blocks) and from an HF checkpoint (`_blocks` / `_scales`), each against transformers on the same values."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.layers.formats import gguf_linear
from lmserve.layers.formats.gguf_linear import S8, GGUFLinear, dequantize
from lmserve.layers.kernels.moe_kernels import NativeExperts, apply_moe_kernels
from lmserve.layers.kernels.native import native_module
from lmserve.models.gpt_oss import mxfp4_dequantize
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer
from lmserve.worker.transforms import load_formatted
from tests.test_model_families import GREEDY_BATCH, assert_close, prompts, reference_greedy
from tests.test_model_parity import flat_logits
from tests.tiny_models import build_hf, write_gguf

LENS = (1, 12, 45)  # one, and past the window of 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    path, ref = build_hf("gpt_oss", root)
    return root, path, ref


def _logits(source, batch):
    model = load_formatted(source, torch.float32, torch.device("cpu"), quantization="none").model
    return model, flat_logits(model, batch)


def _their_logits(ref, batch):
    with torch.no_grad():
        return [ref(torch.tensor([p])).logits[0] for p in batch]


def test_yarn_table_as_released_configs_set_it():
    """gpt-oss's config (truncate False, factor 32 over 4096, theta 150000): frequencies and cos/sin scale equal
    transformers' own YaRN; llama.cpp's truncated ramp (truncate True) too."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lmserve.models.config_hf import config_from_hf
    from lmserve.models.rope import rope_specs

    for truncate in (False, True):
        hf = transformers.GptOssConfig(num_hidden_layers=2, hidden_size=64, head_dim=64, num_attention_heads=2,
                                       num_key_value_heads=1, num_local_experts=4, intermediate_size=64,
                                       rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                                            beta_fast=32.0, beta_slow=1.0, truncate=truncate,
                                                            original_max_position_embeddings=4096))
        want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
        raw = json.loads(hf.to_json_string()) | {"architectures": ["GptOssForCausalLM"]}
        freq, scale = rope_specs(config_from_hf(raw))["full"]
        assert torch.equal(freq, want_freq.float()) and scale == pytest.approx(want_scale, rel=1e-12)
        assert scale > 1.3  # 0.1 ln 32 + 1


def test_large_sinks_match_transformers_and_change_the_output(tiny, tmp_path):
    """Sinks of +6 take most of each softmax (queries mostly attend to nothing): still within 1e-4 of transformers,
    and far from the same model with its sinks at -inf (plain softmax attention)."""
    _, _, base = tiny
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(6.0)
    ref.save_pretrained(tmp_path / "sinks", safe_serialization=True)
    batch = prompts(LENS)
    model, ours = _logits(tmp_path / "sinks", batch)
    for o, t in zip(ours, _their_logits(ref, batch)):
        assert_close(o, t)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    for o, plain in zip(ours, flat_logits(model, batch)):
        assert ((o - plain).abs().max() / o.abs().max()).item() > 0.05


# ---- MXFP4 -------------------------------------------------------------------------------------------------------

def _mxfp4_ref(ref):
    """transformers' model with every expert weight replaced by gguf's MXFP4 round trip (quantize, dequantize), and
    ggml's blocks of each: name -> uint8 [E, out, K / 32 * 17] (HF's rows: gate and up interleaved)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    ref = copy.deepcopy(ref)
    blocks = {}
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            ex = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(ex, name).detach().transpose(1, 2).contiguous().numpy()  # [E, out, in]
                q = quantize(w, Q.MXFP4)
                getattr(ex, name).copy_(torch.from_numpy(dequantize(q, Q.MXFP4)).transpose(1, 2))
                blocks[f"model.layers.{i}.mlp.experts.{name}"] = q
    return ref, blocks


def _hf_layout(ggml: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows [..., G * 17] (exponent, then low nibbles = values 0-15, high = 16-31) -> HF's `_blocks`
    [..., G, 16] (byte j: value 2j low, 2j + 1 high) and `_scales` [..., G]."""
    g = torch.from_numpy(ggml.reshape(*ggml.shape[:-1], -1, 17).copy())
    scales, qs = g[..., 0], g[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., G, 32] in value order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).contiguous(), scales.contiguous()


def test_mxfp4_dequantize_is_transformers_bit_for_bit():
    """models/gpt_oss.mxfp4_dequantize equals transformers' convert_moe_packed_tensors (float32) on every code and a
    spread of exponents (subnormal scales included)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (3, 8, 4), dtype=torch.uint8, generator=g)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 1
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, K, 8]
    assert torch.equal(mxfp4_dequantize(blocks, scales).transpose(1, 2), want)


def test_mxfp4_experts_from_gguf_and_hf_checkpoint(tiny, tmp_path, monkeypatch):
    """The same MXFP4 experts from a GGUF written with the gguf package (ggml's blocks) and from an HF checkpoint
    (`_blocks` / `_scales`, quantization_config mxfp4, as the released gpt-oss): both within 1e-4 of transformers
    holding the dequantized values, and 32 greedy tokens identical through the engine on 3 prompts."""
    root, path, base = tiny
    ref, ggml = _mxfp4_ref(base)
    gguf = write_gguf("gpt_oss", ref, tmp_path / "mxfp4.gguf",
                      lambda n: "MXFP4" if n.endswith("_exps.weight") else "F32")
    hf = tmp_path / "hf_mxfp4"
    ref.save_pretrained(hf, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (hf / f).write_text((path / f).read_text())
    tensors = load_file(hf / "model.safetensors")
    for name, q in ggml.items():
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _hf_layout(q)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (hf / "config.json").write_text(json.dumps(config))

    from gguf import GGMLQuantizationType as Q

    from lmserve.loader.gguf_file import read_gguf

    kinds = {Q(t.ggml_type).name for t in read_gguf(gguf).tensors if "_exps.weight" in t.name}
    assert kinds == {"MXFP4"}
    batch = prompts(LENS)
    theirs = _their_logits(ref, batch)
    for source in (gguf, hf):
        for o, t in zip(_logits(source, batch)[1], theirs):
            assert_close(o, t)
    want = reference_greedy(ref, GREEDY_BATCH[:3])
    for source in (gguf, hf):
        eng = LLMEngine(EngineConfig(model=str(source), quantization="none", dtype="float32",
                                     cache=CacheConfig(num_blocks=48, block_size=16),
                                     scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=24)),
                        tokenizer=Tokenizer.from_pretrained(path))
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        out = {str(i): [] for i in range(3)}
        for i in range(3):
            eng.add_request(str(i), GREEDY_BATCH[i], params)
        while eng.has_unfinished():
            for d in eng.step():
                out[d.request_id] += d.token_ids
        assert [out[str(i)] for i in range(3)] == want, source.name
    # the default on CPU keeps the GGUF's MXFP4 experts in their codes (held as S8, layers/formats/gguf_linear.py): the
    # weights exactly transformers' values, and the int8-dot kernels equal their dequantize-then-matmul reference
    # (int8 activations, as llama.cpp runs MXFP4: this tiny random model amplifies that rounding to ~5-30% of the
    # largest logit, so the comparison is with the reference, not transformers)
    kept = load_formatted(gguf, torch.float32, torch.device("cpu"), quantization="auto")
    assert kept.weight_format == "gguf"
    for layer, theirs_layer in zip(kept.model.model.layers, ref.model.layers):
        gate_up = theirs_layer.mlp.experts.gate_up_proj.detach()  # [E, hidden, 2I], gate and up interleaved
        for e, expert in enumerate(layer.mlp.experts):
            assert type(expert.gate_up_proj) is GGUFLinear and expert.gate_up_proj.kind == S8
            want = torch.cat([gate_up[e, :, 0::2], gate_up[e, :, 1::2]], dim=1).t()
            assert torch.equal(dequantize(expert.gate_up_proj.repacked()), want)
    native = flat_logits(kept.model, batch)
    # the moe_kernels step: each layer's biased experts stacked for one native call per projection over all rows,
    # the same bits as the per-expert module path, at a decode batch and alone
    if native_module() is not None and native_module().quant_packed_rows():
        assert apply_moe_kernels(kept.model, triton=False) == len(kept.model.model.layers)
        x = torch.randn(16, kept.config.hidden_size, generator=torch.Generator().manual_seed(4))
        for layer in kept.model.model.layers:
            moe = layer.mlp
            assert isinstance(moe.grouped, NativeExperts) and moe.grouped.gate_up.bias is not None
            for rows in (x, x[:1]):
                assert moe.grouped.accepts(rows, moe.route(rows))
                fast = moe(rows)
                grouped, moe.grouped = moe.grouped, None
                assert torch.equal(fast, moe(rows))
                moe.grouped = grouped
        assert all(torch.equal(a, b) for a, b in zip(native, flat_logits(kept.model, batch)))
    monkeypatch.setattr(gguf_linear, "native_module", lambda: None)  # GGUFLinear's reference path
    for layer in kept.model.model.layers:
        layer.mlp.grouped = None
    for o, r in zip(native, flat_logits(kept.model, batch)):
        assert_close(o, r, tol=1e-5)


def test_tensor_parallel_splits_sinks_with_their_heads_and_adds_expert_biases_once(tmp_path):
    """TP=2: each rank holds its query heads' sinks and half of every expert's width with its gate/up biases; the
    experts' down biases (zeroed off rank 0) are added once by the layer's all-reduce. Rank 0's logits equal one
    rank's."""
    from tests.test_tp import one_rank_logits, tp_logits

    path, _ = build_hf("gpt_oss", tmp_path, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    ref = one_rank_logits(path)
    got = tp_logits(path, 2)
    assert (got - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_what_it_cannot_do_yet_is_declined(tiny):
    """CUDA graphs are declined (decode runs eagerly) even with one KV group, as the biased experts' module path
    reads run lengths on the host."""
    from lmserve.cache.sizing import blocks_for

    _, path, _ = tiny
    eng = LLMEngine(EngineConfig(model=str(path), quantization="none",
                                 cache=CacheConfig(num_blocks=32, hybrid_kv_cache=False)),
                    tokenizer=Tokenizer.from_pretrained(path))
    assert eng.runner.num_kv_groups == 1
    assert eng.runner.enable_decode_graphs(4, blocks_for(eng.max_model_len, eng.block_size), capture=False) == 0.0
    assert eng.runner.graphs is None
