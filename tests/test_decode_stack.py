"""The native decode stack (layers/kernels/decode_stack.py): every layer of a decode-only step in one C++ call must give
exactly the PyTorch module loop's outputs (same kernels, same order), and stand aside where it does not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmserve.layers.kernels.decode_stack import (
    DecodeStack,
    LayerWeights,
    NativeDecodeLoop,
    Shape,
    apply_decode_stack,
    remove_decode_stack,
)
from lmserve.layers.kernels.native import native_module, widens_half_fast

needs_native = pytest.mark.skipif(native_module() is None, reason="native kernels unavailable (no compiler)")


@pytest.fixture(scope="module")
def gguf_engine():
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(quantization="gguf", cache=CacheConfig(num_blocks=128, block_size=16,
                                                               enable_prefix_caching=False)))  # same cache state per run


def generate(eng, prompts, params) -> dict:
    """Tokens and every logprob (chosen and top-k) of each prompt, all in one continuous batch."""
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    out = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id] += [(t.token_id, t.logprob, tuple(t.top)) for t in d.logprobs]
    return out


@needs_native
def test_decode_steps_through_the_stack_equal_the_module_loop_bitwise(gguf_engine):
    """Three prompts of different lengths, 30 sampled tokens each (block boundaries crossed, rows joining and
    leaving the batch): tokens and logprobs (chosen and top-3) are bit-identical with the stack on and off,
    and the stack really ran."""
    from lmserve.sampling_params import SamplingParams
    from tests.test_engine import PROMPTS, assert_no_leak

    model = gguf_engine.loaded.model
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True, logprobs=3)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    assert isinstance(model.layer_loop, NativeDecodeLoop)  # the runner applied the transform
    remove_decode_stack(model)
    reference = generate(gguf_engine, prompts, params)
    stack = apply_decode_stack(model)
    assert stack is not None
    fused = generate(gguf_engine, prompts, params)
    assert stack.steps >= 25  # every decode-only step went through it
    assert fused == reference
    assert_no_leak(gguf_engine)


@needs_native
def test_a_lora_engine_runs_adapter_and_base_rows_through_the_stack(tmp_path):
    """With LoRA wrappers on every projection, decode steps run the stack on the wrappers' bases: steps where no row
    carries an adapter, and mixed steps (two adapters of other ranks and targets beside base rows), which add the
    deltas inside the stack. Tokens and logprobs are bit-identical to the module loop's (the reference) alone."""
    from lmserve.config import CacheConfig, EngineConfig, LoraConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.loader import default_model_path
    from lmserve.sampling_params import SamplingParams
    from tests.lora_adapters import make_peft_adapter
    from tests.test_engine import PROMPTS, assert_no_leak

    smol = default_model_path()
    a = make_peft_adapter(tmp_path / "a", smol, rank=8, target_modules=("q_proj", "v_proj", "down_proj"))
    b = make_peft_adapter(tmp_path / "b", smol, rank=16, seed=3,
                          target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    eng = LLMEngine(EngineConfig(quantization="gguf", lora=LoraConfig((("a", str(a)), ("b", str(b))), max_loras=2,
                                                                      max_lora_rank=16),
                                 cache=CacheConfig(num_blocks=128, enable_prefix_caching=False)))
    model = eng.loaded.model
    # --lora-dtype auto over the GGUF blocks: the 16-bit kernel path where the build widens float16 in vector loads
    assert eng.lora_slots.lora_dtype == (torch.float16 if widens_half_fast() else torch.float32)
    assert isinstance(model.layer_loop, NativeDecodeLoop) and len(model.layer_loop.wrappers) == 4 * len(
        model.model.layers)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(loras: list[str | None]) -> dict:
        for i, name in enumerate(loras):
            eng.add_request(f"r{i}", PROMPTS[i], params, lora=eng.loras.get(name) if name else None)
        out: dict = {}
        while eng.has_unfinished():
            for d in eng.step():
                out.setdefault(d.request_id, []).extend((t.token_id, t.logprob, tuple(t.top)) for t in d.logprobs)
        return out

    stack = eng.runner.decode_stack
    mixed = ["a", None, "b", "a", None]
    base, steps = run([None]), stack.steps
    assert steps >= 10 and stack.lora_steps == 0  # the base request's decode steps ran the stack
    adapted = run(["a"])
    together = run(mixed)
    assert stack.lora_steps >= 20 and stack.steps >= steps + 20  # the adapter steps ran the stack too
    assert adapted["r0"] != base["r0"]  # and the adapter mattered
    remove_decode_stack(model)
    assert run([None]) == base and run(["a"]) == adapted and run(mixed) == together
    assert_no_leak(eng)


@needs_native
def test_the_stack_stands_aside_for_other_layers(gguf_engine):
    """A projection that is not exactly a GGUFLinear (float, LoRA or parallel wrapper) means no stack; so do head
    layouts the attention kernel lacks. The float (dequantized) model never builds one."""
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine

    cfg = gguf_engine.model_config
    layers = [LayerWeights(l.input_layernorm.weight, l.post_attention_layernorm.weight,
                           (l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj))
              for l in gguf_engine.loaded.model.model.layers]
    shape = Shape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
    assert DecodeStack.build(layers, shape) is not None
    swapped = LayerWeights(layers[3].in_norm, layers[3].post_norm,
                           (nn.Linear(cfg.hidden_size, 8),) + layers[3].projections[1:])
    assert DecodeStack.build(layers[:3] + [swapped] + layers[4:], shape) is None
    assert DecodeStack.build(layers, Shape(cfg.num_heads, cfg.num_kv_heads, 96, cfg.rms_norm_eps)) is None
    float_eng = LLMEngine(EngineConfig(quantization="none", cache=CacheConfig(num_blocks=8)))
    assert float_eng.runner.decode_stack is None and apply_decode_stack(float_eng.loaded.model) is None


def test_kept_gguf_blocks_keep_their_kv_in_float16(gguf_engine):
    """--kv-cache-dtype auto: float16 for a GGUF file's kept blocks (as llama.cpp), half the bytes of float32;
    float32 still on request, over the same loaded model."""
    import torch

    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.sampling_params import SamplingParams
    from tests.test_engine import PROMPTS, assert_no_leak

    assert gguf_engine.kv_dtype == torch.float16
    assert all(c.dtype == torch.float16 for c in gguf_engine.runner.kv_caches)
    wide = LLMEngine(EngineConfig(quantization="gguf", cache=CacheConfig(num_blocks=128, kv_cache_dtype="float32")),
                     loaded=gguf_engine.loaded, tokenizer=gguf_engine.tokenizer)
    assert wide.kv_dtype == torch.float32 and all(c.dtype == torch.float32 for c in wide.runner.kv_caches)
    assert gguf_engine.block_bytes * 2 == wide.block_bytes
    out = generate(wide, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1))
    assert len(out["0"]) == 8
    assert_no_leak(wide)
