"""The model transform pipeline (worker/transforms.py): load_model builds the model pure, and each step of TRANSFORMS,
applied alone, keeps the model's logits (or greedy tokens) those of the untransformed model.

Parity of each step against the untransformed model, here and where it already lived:
- weight_format: packing, here (tiny Llama, logits and greedy tokens); int8/int4 against float:
  test_quantized.py::test_quantized_embedded_model_stays_close_to_float; the packed embedded GGUF against
  transformers: test_model_parity.py::test_embedded_gguf_matches_transformers.
- tensor_parallel: one rank is the model itself, here; two and three ranks against one:
  test_tp.py::test_tp2_logits_equal_tp1, test_tp.py::test_embedded_gguf_tp3_logits_equal_tp1.
- pipeline_parallel: one rank is the model itself (no stage: unchanged); two ranks against one:
  test_pp.py::test_pp2_logits_equal_one_rank.
- lora: with no adapter in the step, bit-identical, here; with adapters against PEFT:
  test_lora.py::test_tiny_safetensors_llama_matches_peft.
- moe_kernels: test_moe.py::test_native_grouped_float_experts_equal_the_module_path and
  ::test_native_grouped_gguf_experts_equal_the_module_path (the grouped kernels against the module path); a model
  without experts is unchanged, here.
- decode_stack: test_decode_stack.py::test_decode_steps_through_the_stack_equal_the_module_loop_bitwise; a float
  model keeps its module loop, here.
- warm_up: leaves every weight and logit as it was, here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmserve.config import LoraConfig
from lmserve.layers.formats.linear import PackedLinear, can_pack
from lmserve.layers.formats.quantized import Int8Linear
from lmserve.loader import load_model
from lmserve.worker import transforms
from lmserve.worker.transforms import TRANSFORMS, WEIGHT_STEPS, TransformContext, apply_transforms
from tests.conftest import write_tiny_llama
from tests.test_model_parity import assert_parity, flat_logits, prompts_for

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("transforms") / "tiny"
    write_tiny_llama(path)
    return path


def pure(path, **kwargs):
    return load_model(path, torch.float32, CPU, **kwargs)


def greedy(model: nn.Module, prompt: list[int], steps: int = 8) -> list[int]:
    """Greedy tokens by re-running the whole sequence each step (no cache: only the model's own forward)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(flat_logits(model, [ids])[0][-1].argmax()))
    return ids[len(prompt):]


def test_the_pipeline_lists_every_step_in_order():
    assert [s.__name__ for s in TRANSFORMS] == ["weight_format", "tensor_parallel", "pipeline_parallel",
                                                "lora", "moe_kernels", "decode_stack", "warm_up"]
    assert WEIGHT_STEPS == TRANSFORMS[:3]
    assert all(getattr(transforms, s.__name__) is s for s in TRANSFORMS)  # each a named function of the module


def test_load_model_builds_the_model_pure(tiny):
    """No weight format is applied while loading: every projection is the model code's own nn.Linear."""
    model = pure(tiny).model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is nn.Linear for m in linears)
    assert "applied_transforms" not in model.__dict__


@pytest.mark.skipif(not can_pack(CPU, torch.float32), reason="no oneDNN packing on this CPU")
def test_weight_format_packs_and_keeps_logits_and_greedy_tokens(tiny):
    ref, loaded = pure(tiny).model, pure(tiny)
    prompts = prompts_for(ref.config.vocab_size)
    want = flat_logits(ref, prompts)
    apply_transforms(TransformContext(loaded, CPU, torch.float32), (transforms.weight_format,))
    assert any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    for ours, theirs in zip(flat_logits(loaded.model, prompts), want):
        assert_parity(ours, theirs)
    assert greedy(loaded.model, prompts[1]) == greedy(ref, prompts[1])


def test_weight_steps_run_once_per_model(tiny):
    """A model reused by another engine keeps its weight format: a second pipeline run does not quantize twice."""
    loaded = pure(tiny, quantization="int8")
    apply_transforms(TransformContext(loaded, CPU, torch.float32))
    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Int8Linear)}
    assert layers and loaded.model.applied_transforms >= {"weight_format", "tensor_parallel"}
    apply_transforms(TransformContext(loaded, CPU, torch.float32))
    assert {n: m for n, m in loaded.model.named_modules() if isinstance(m, Int8Linear)} == layers


def test_tensor_parallel_on_one_rank_is_the_model_itself(tiny):
    loaded = pure(tiny)
    model = loaded.model
    want = flat_logits(model, prompts_for(model.config.vocab_size))
    apply_transforms(TransformContext(loaded, CPU, torch.float32), (transforms.tensor_parallel,))
    assert loaded.model is model
    assert all(torch.equal(a, b) for a, b in zip(flat_logits(model, prompts_for(model.config.vocab_size)), want))


def test_lora_without_an_adapter_in_the_step_is_bitwise_the_base(tiny):
    loaded = pure(tiny)
    prompts = prompts_for(loaded.config.vocab_size)
    want = flat_logits(loaded.model, prompts)
    ctx = apply_transforms(TransformContext(loaded, CPU, torch.float32, lora=LoraConfig(max_loras=2, max_lora_rank=8)),
                           (transforms.lora,))
    assert ctx.lora_slots is not None and len(ctx.lora_slots.wrappers) == 4 * loaded.config.num_layers
    assert ctx.lora_slots.batch.meta is None  # has_lora off: every row on the base path
    assert all(torch.equal(a, b) for a, b in zip(flat_logits(loaded.model, prompts), want))


def test_moe_kernels_and_decode_stack_leave_a_dense_float_model_as_it_is(tiny):
    """No experts: no grouped kernels; float projections: no native stack (the module loop runs)."""
    loaded = pure(tiny)
    loop = loaded.model.layer_loop
    want = flat_logits(loaded.model, prompts_for(loaded.config.vocab_size))
    ctx = apply_transforms(TransformContext(loaded, CPU, torch.float32),
                           (transforms.moe_kernels, transforms.decode_stack))
    assert ctx.moe_layers == 0 and ctx.decode_stack is None and loaded.model.layer_loop is loop
    got = flat_logits(loaded.model, prompts_for(loaded.config.vocab_size))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_warm_up_changes_no_weight_and_no_logit(tiny):
    loaded = pure(tiny)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    prompts = prompts_for(loaded.config.vocab_size)
    want = flat_logits(loaded.model, prompts)
    apply_transforms(TransformContext(loaded, CPU, torch.float32, kv_dtype=torch.float16), (transforms.warm_up,))
    after = loaded.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, b) for a, b in zip(flat_logits(loaded.model, prompts), want))


def test_the_whole_pipeline_keeps_greedy_tokens(tiny):
    ref, loaded = pure(tiny).model, pure(tiny)
    prompt = prompts_for(ref.config.vocab_size)[1]
    apply_transforms(TransformContext(loaded, CPU, torch.float32, lora=LoraConfig(max_loras=1, max_lora_rank=8)))
    assert loaded.model.applied_transforms == {s.__name__ for s in TRANSFORMS}
    assert greedy(loaded.model, prompt) == greedy(ref, prompt)
