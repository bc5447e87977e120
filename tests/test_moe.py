"""Mixture of experts (layers/blocks/moe.py): the sorted-by-expert layer against a token-by-token reference, batch invariance
on the float (oneDNN-packed) and GGUF-block paths, GGUF `*_exps` experts kept in their blocks one slice at a time
against the dequantized float model, Qwen's dense layers (`decoder_sparse_step`, `mlp_only_layers`), tensor
parallelism, the native grouped experts (layers/kernels/moe_kernels.py: one kernel call per projection) against the
module path, and a Qwen3-MoE served to the openai client. The per-family parity (logits and greedy tokens against
transformers, both formats, chunked prefill and prefix caching) is in tests/test_model_families.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lmserve.layers.blocks.moe import SparseMoE, reference_moe, route
from lmserve.layers.formats.gguf_linear import GGUFLinear, dequantize
from lmserve.layers.formats.linear import pack_linears
from lmserve.layers.kernels.moe_kernels import NativeExperts, StackedGGUF, StackedPanels, apply_moe_kernels
from lmserve.loader import load_model
from lmserve.worker.transforms import load_formatted
from tests.test_model_families import assert_close, prompts
from tests.test_model_parity import flat_logits
from tests.tiny_models import build_hf, write_gguf

CPU = torch.device("cpu")
# experts in two block layouts (gate/up 4-bit with a min, down 8-bit), the router left F32 as llama.cpp's converters do
EXPERT_KINDS = {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0"}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """(HF directory, transformers model, GGUF with quantized experts) of the tiny Qwen3-MoE (8 experts, top-2)."""
    root = tmp_path_factory.mktemp("moe")
    path, ref = build_hf("qwen3_moe", root)
    gguf = write_gguf("qwen3_moe", ref, root / "q.gguf", lambda n: EXPERT_KINDS.get(n.split(".")[-2], "Q8_0"))
    return path, ref, gguf


def random_moe(shared: int = 0, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(64, 48, num_experts=8, top_k=2, renormalize=shared == 0, shared_size=shared).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize("shared", [0, 32])
def test_sorted_experts_match_the_token_by_token_reference(shared):
    """Grouping by expert, one call per active expert and the per-token weighted sum give the reference's numbers
    (with and without Qwen2-MoE's shared expert), and every expert is used by some token."""
    moe = random_moe(shared)
    x = torch.randn(40, 64)
    with torch.no_grad():
        assert torch.allclose(moe(x), reference_moe(x, moe), rtol=1e-5, atol=1e-5)
        used = torch.topk(moe.gate(x), 2).indices.unique()
    assert len(used) == 8


def rows_alone_equal_rows_in_batch(layer: nn.Module, x: torch.Tensor) -> bool:
    with torch.inference_mode():
        full = layer(x)
        return torch.equal(full, torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])]))


def test_a_rows_result_does_not_depend_on_its_batch(qwen3_moe):
    """A row alone and in a batch of 16, bit for bit (as tests/test_quantized.py asks of the linears): the float
    layer as the engine packs it (oneDNN, the skinny kernel for a few rows) and the GGUF-block layer."""
    moe = pack_linears(random_moe(32))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    assert rows_alone_equal_rows_in_batch(moe, x)
    packed = load_formatted(qwen3_moe[2], torch.float32, CPU, quantization="gguf").model
    layer = packed.model.layers[0].mlp
    assert isinstance(layer.experts[0].gate_up_proj, GGUFLinear)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(5))
    assert rows_alone_equal_rows_in_batch(layer, x)


def module_path_and_grouped(layer: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output through the module path (the reference) and through its grouped fast path."""
    grouped, layer.grouped = layer.grouped, None
    with torch.inference_mode():
        plain = layer(x)
        layer.grouped = grouped
        assert grouped.accepts(x, route(layer.gate(x), layer.top_k, layer.renormalize))
        return plain, layer(x)


@pytest.mark.parametrize("shared", [0, 32])
def test_native_grouped_float_experts_equal_the_module_path(shared):
    """The oneDNN-packed experts stacked as skinny-kernel panels: each projection one native call over the rows sorted
    by expert gives the module path's bits (batch 16 and batch 1) and the token-by-token reference's numbers; the
    experts' own panels are views of the stack (one copy of the weights); past 8 rows an expert it declines."""
    moe = pack_linears(random_moe(shared))
    assert apply_moe_kernels(moe, triton=False) == 1
    assert isinstance(moe.grouped, NativeExperts) and isinstance(moe.grouped.gate_up, StackedPanels)
    stack = moe.grouped.gate_up.panels
    assert moe.experts[3].gate_up_proj.panels.data_ptr() == stack[3].data_ptr()
    for rows in (16, 1):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        plain, fast = module_path_and_grouped(moe, x)
        assert torch.equal(plain, fast)
        with torch.no_grad():
            torch.testing.assert_close(fast, reference_moe(x, moe), rtol=1e-5, atol=1e-5)
    assert rows_alone_equal_rows_in_batch(moe, torch.randn(16, 64))
    big = torch.randn(40, 64)  # 80 pairs > 8 rows x 8 experts: the module path (oneDNN) runs the step
    with torch.inference_mode():
        assert not moe.grouped.accepts(big, route(moe.gate(big), 2, moe.renormalize))


def test_native_grouped_gguf_experts_equal_the_module_path(qwen3_moe):
    """GGUF experts (Q4_1 gate/up, Q8_0 down) stacked in the packed layout: one `quant_linear_experts` call per
    projection reads every expert's blocks in place and gives the per-expert GGUFLinear bits, at batch 16 and 1."""
    from lmserve.layers.kernels import native

    if native.native_module() is None or native.native_module().quant_packed_rows() == 0:
        pytest.skip("the packed GGUF layout needs the AVX-512 VNNI build")
    packed = load_formatted(qwen3_moe[2], torch.float32, CPU, quantization="gguf").model
    layers = packed.model.layers
    assert apply_moe_kernels(packed, triton=False) == len(layers)
    for layer in layers:
        fast = layer.mlp.grouped
        assert isinstance(fast.gate_up, StackedGGUF) and isinstance(fast.down, StackedGGUF)
        assert (fast.gate_up.kind, fast.down.kind) == (layer.mlp.experts[0].gate_up_proj.kind,
                                                       layer.mlp.experts[0].down_proj.kind)
        assert layer.mlp.experts[5].down_proj.codes.data_ptr() == fast.down.codes[5].data_ptr()
        for rows in (16, 1):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
            plain, grouped = module_path_and_grouped(layer.mlp, x)
            assert torch.equal(plain, grouped)
    assert rows_alone_equal_rows_in_batch(layers[0].mlp, torch.randn(16, 128))


def test_gguf_experts_stay_in_their_blocks_and_match_the_dequantized_reference(qwen3_moe, monkeypatch):
    """`--quantization gguf` (and `auto`): every expert's gate_up and down read its slice of the 3-D `*_exps` blocks
    (their dequantized weights are the float path's, exactly) and the router stays float. Each MoE layer equals its
    reference path (every expert dequantized and multiplied in float64 with the kernel's int8 activations,
    `gguf_linear.reference_linear`) on the same input, and the model's greedy choices follow the float model's
    (int8 activations, as llama.cpp: a whole model's outputs drift apart by rounding, not by a wrong expert)."""
    from lmserve.layers.kernels import native

    _, _, gguf = qwen3_moe
    packed = load_formatted(gguf, torch.float32, CPU, quantization="gguf")
    apply_moe_kernels(packed.model, triton=False)  # the pipeline's moe_kernels step: the grouped kernels where they run
    plain = load_model(gguf, torch.float32, CPU, quantization="none").model
    assert packed.weight_format == "gguf"
    assert load_formatted(gguf, torch.float32, CPU, quantization="auto").weight_format == "gguf"
    for layer, ref in zip(packed.model.model.layers, plain.model.layers):
        assert not isinstance(layer.mlp.gate, GGUFLinear)
        for ours, theirs in zip(layer.mlp.experts, ref.mlp.experts):
            for proj in ("gate_up_proj", "down_proj"):
                kept = getattr(ours, proj)
                assert isinstance(kept, GGUFLinear)
                assert torch.equal(dequantize(kept.repacked()), getattr(theirs, proj).weight.detach())
    batch = prompts((5, 30, 19))
    agree = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(flat_logits(packed.model, batch),
                                                                      flat_logits(plain, batch))])
    assert agree.float().mean().item() > 0.9
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        fast = [layer.mlp(x) for layer in packed.model.model.layers]
        monkeypatch.setattr(native, "_on", False)  # every layer's reference path (LMSERVE_NATIVE_KERNELS=0)
        for layer, out in zip(packed.model.model.layers, fast):
            ref = layer.mlp(x)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_qwen_dense_layers_follow_sparse_step_and_mlp_only_layers(tmp_path):
    """decoder_sparse_step 2 and mlp_only_layers [3] over 4 layers: only layer 1 routes to experts; logits match."""
    path, ref = build_hf("qwen3_moe", tmp_path, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    loaded = load_formatted(path, torch.float32, CPU)
    assert [isinstance(layer.mlp, SparseMoE) for layer in loaded.model.model.layers] == [False, True, False, False]
    assert loaded.config.dense_layers == (0, 2, 3)
    batch = prompts((7, 19))
    for prompt, ours in zip(batch, flat_logits(loaded.model, batch)):
        with torch.no_grad():
            assert_close(ours, ref(torch.tensor([prompt])).logits[0])


def test_tensor_parallel_splits_every_experts_width(tmp_path):
    """TP=2 on Qwen2-MoE (a shared expert beside the routed ones): each rank holds half of every expert's
    intermediate width, the layer is all-reduced once, and rank 0's logits equal one rank's."""
    from lmserve.loader import read_model_config
    from lmserve.loader.sharding import local_config
    from tests.test_tp import one_rank_logits, tp_logits

    path, _ = build_hf("qwen2_moe", tmp_path, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    half = local_config(read_model_config(path), 2)
    assert (half.expert_size, half.shared_expert_intermediate_size) == (32, 48)
    ref = one_rank_logits(path)
    got = tp_logits(path, 2)
    assert (got - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_lora_on_experts_is_refused_with_a_clear_error(qwen3_moe, tmp_path):
    """A PEFT adapter that targets an MoE layer's MLP names the layer and what to target instead."""
    from lmserve.loader import read_model_config
    from lmserve.lora.peft_adapter import AdapterError, read_peft_adapter
    from tests.lora_adapters import write_random_adapter

    cfg = read_model_config(qwen3_moe[0])
    attention_only = write_random_adapter(tmp_path / "attn", cfg, target_modules=["q_proj", "o_proj"])
    assert read_peft_adapter(attention_only, cfg, name="attn").target_modules == ("o_proj", "q_proj")
    experts = write_random_adapter(tmp_path / "mlp", cfg, target_modules=["q_proj", "gate_proj"])
    with pytest.raises(AdapterError, match="layer 0 is a mixture of experts"):
        read_peft_adapter(experts, cfg, name="mlp")


def test_served_to_the_openai_client(qwen3_moe):
    """`lmserve serve --model <Qwen3-MoE directory>` answers a completion with the engine's greedy tokens."""
    from openai import OpenAI

    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.tokenizer import Tokenizer
    from tests.server_util import running_server
    from tests.test_gemma3_real import generate

    path = qwen3_moe[0]
    tok = Tokenizer.from_pretrained(path)
    prompt = " ".join(f"w{i}" for i in np.random.default_rng(3).integers(0, 200, 24))
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(num_blocks=32)), tokenizer=tok)
    assert eng.runner.moe_layers == len(eng.runner.model.model.layers)  # the pipeline's moe_kernels step
    want = generate(eng, [tok.encode_prompt(prompt)], 12)
    with running_server("--model", str(path), "--dtype", "float32", "--served-model-name", "moe") as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused")
        done = client.completions.create(model="moe", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 12
    # the same 12 words (the streaming detokenizer puts the space after the prompt's last word in front)
    assert done.choices[0].text.split() == tok.decode(want[0]).split()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_native_decode_stack_runs_the_experts_as_the_module_loop(arch, tmp_path):
    """A Q8_0 GGUF of a tiny Qwen3-MoE (renormalised top-k, QK-norm) and Mixtral (a `llama` file with experts): the
    runner's decode stack takes every layer, routing and grouped experts included (decode_stack.h `MoeMlp`), and a
    batch of three requests gives the same greedy tokens as with the stack removed (the module loop: the router, then
    the grouped experts of layers/kernels/moe_kernels.py, the reference), and logprobs (chosen and top-3) within
    float error: the stack routes and sums in plain loops (exp and the order of the sums round differently)."""
    from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.layers.kernels import native
    from lmserve.layers.kernels.decode_stack import apply_decode_stack, remove_decode_stack
    from lmserve.sampling_params import SamplingParams
    from lmserve.tokenizer import Tokenizer
    from tests.test_decode_stack import generate

    if native.native_module() is None or native.native_module().quant_packed_rows() == 0:
        pytest.skip("the grouped GGUF experts need the packed layout")
    path, ref = build_hf(arch, tmp_path)
    gguf = write_gguf(arch, ref, tmp_path / "q8.gguf", lambda n: "Q8_0")
    eng = LLMEngine(EngineConfig(model=str(gguf), quantization="gguf",
                                 cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),  # the same cache state
                                 scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)),
                    tokenizer=Tokenizer.from_pretrained(path))
    stack, model = eng.runner.decode_stack, eng.loaded.model
    assert stack is not None and eng.runner.moe_layers == len(model.model.layers)
    batch = prompts((5, 21, 12))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    fused = generate(eng, batch, params)
    assert stack.steps >= 20  # the decode steps ran the stack
    remove_decode_stack(model)
    reference = generate(eng, batch, params)
    assert {k: [t[0] for t in v] for k, v in fused.items()} == {k: [t[0] for t in v] for k, v in reference.items()}
    for request, steps in reference.items():
        for (_, logprob, top), (_, ours, our_top) in zip(steps, fused[request]):
            assert abs(ours - logprob) < 1e-2  # int8 activations: a last-bit change can move a code
            assert [t[0] for t in our_top] == [t[0] for t in top]
            assert np.allclose([t[1] for t in our_top], [t[1] for t in top], atol=1e-2)
    assert apply_decode_stack(model) is not None
