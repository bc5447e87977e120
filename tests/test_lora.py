"""Multi-LoRA: the batched delta against the per-row reference, logits against transformers + PEFT, mixed
batches against each request alone, device slots in the scheduler and per-adapter prefix caching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lmserve.config import CacheConfig, EngineConfig, LoraConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.errors import ConfigError
from lmserve.layers.formats.linear import PackedLinear, can_pack
from lmserve.layers.formats.quantized import Int4Linear, Int8Linear
from lmserve.layers.kernels.native import widens_half_fast
from lmserve.lora.layers import LoraBatch, LoraLinear, LoraSlice, lora_delta_reference
from lmserve.lora.peft_adapter import read_peft_adapter
from lmserve.lora.slots import LoraSlots
from lmserve.request import LoRARequest
from lmserve.sampling_params import SamplingParams
from lmserve.worker.transforms import load_formatted
from lmserve.worker.upload import to_device
from tests.conftest import save_tiny_hf
from tests.lora_adapters import make_peft_adapter, peft_reference, reference_logits, tiny_llama_checkpoint
from tests.test_model_parity import TOL, assert_parity, flat_logits

CPU = torch.device("cpu")


def set_step(slots: LoraSlots, token_slots: list[int]) -> None:
    slots.batch.meta = to_device(slots.step_meta(np.asarray(token_slots, dtype=np.int64)), CPU)


# -- the batched delta against the per-row reference, on every weight format ----------------------------------

def _bases(linear: nn.Linear) -> dict[str, nn.Module]:
    bases = {"linear": linear, "int8": Int8Linear(linear), "int4": Int4Linear(linear)}
    if can_pack(CPU, torch.float32):
        bases["packed"] = PackedLinear(linear)
    return bases


@pytest.mark.parametrize("fmt", ["linear", "packed", "int8", "int4"])
def test_batched_delta_matches_reference_and_keeps_base_rows(fmt):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96 + 32 + 32, bias=False)
    base = _bases(linear).get(fmt)
    if base is None:
        pytest.skip("oneDNN packing is not available here")
    slices = [LoraSlice("q_proj", 0, 96), LoraSlice("k_proj", 96, 32), LoraSlice("v_proj", 128, 32)]
    layer = LoraLinear(base, slices, LoraBatch(), max_loras=3, max_rank=8, in_features=64, dtype=torch.float32,
                       device=CPU)
    with torch.no_grad():
        layer.lora_a.normal_()
        for i in range(3):
            layer.lora_b(i).normal_()
        layer.lora_b(1)[2].zero_()  # slot 2 has no k_proj: only q and v change
    x = torch.randn(11, 64)
    token_slots = [-1, 0, 2, 2, -1, 1, 0, 0, 0, 2, -1]
    y_base = base(x)
    from lmserve.lora.batch import lora_segments

    layer.batch.meta = to_device(lora_segments(np.asarray(token_slots), [8, 8, 8]), CPU)
    with torch.inference_mode():
        y = layer(x)
        ref = lora_delta_reference(layer, x, y_base, token_slots)
    base_rows = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(y[base_rows], y_base[base_rows]), "base rows must be the base layer's output, bit for bit"
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[[2, 3, 9], 96:128], y_base[[2, 3, 9], 96:128]), "an adapter without k_proj leaves k alone"
    assert not torch.allclose(y[1], y_base[1])
    even = [0, 1, 0, 1, -1, 2, 2, 1, 0, 2, -1]  # three rows per slot: no padding, no mask
    layer.batch.meta = to_device(lora_segments(np.asarray(even), [8, 8, 8]), CPU)
    assert not layer.batch.meta.padded
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), lora_delta_reference(layer, x, y_base, even), rtol=1e-5, atol=1e-5)
    layer.batch.meta = to_device(lora_segments(np.asarray(token_slots), [8, 8, 8], max_padding=1.0), CPU)
    assert layer.batch.meta.ragged is not None  # one slot at a time: the path long prefill chunks take
    with torch.inference_mode():
        y_ragged = layer(x)
    assert torch.equal(y_ragged[base_rows], y_base[base_rows])
    torch.testing.assert_close(y_ragged, ref, rtol=1e-5, atol=1e-5)
    layer.batch.meta = None
    assert torch.equal(layer(x), y_base)


# -- logits against transformers + PEFT ------------------------------------------------------------------------

ADAPTERS = ((8, ("q_proj", "v_proj")), (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj")), (8, ("o_proj", "down_proj", "up_proj")))


def _check_against_peft(model_path, tmp_path, prompts_len=(7, 33, 19), slot_dtype=torch.float32, tol=TOL):
    loaded = load_formatted(model_path, torch.float32, CPU)
    slots = LoraSlots(loaded.model, loaded.config, len(ADAPTERS), 16, slot_dtype, CPU)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in prompts_len]
    prompts.append(prompts[0])  # the same prompt on the base model, in the same flat batch
    refs = []
    for i, (rank, targets) in enumerate(ADAPTERS):
        path = make_peft_adapter(tmp_path / f"a{i}", model_path, rank=rank, target_modules=targets, seed=i,
                                 use_rslora=i == 2)
        adapter = read_peft_adapter(path, loaded.config, name=f"a{i}")
        assert slots.acquire(LoRARequest(f"a{i}", i + 1, str(path), adapter), set())
        with peft_reference(model_path, path) as ref:
            refs.append(reference_logits(ref, prompts[i]))
    set_step(slots, [s for i, p in enumerate(prompts) for s in [i if i < len(ADAPTERS) else -1] * len(p)])
    ours = flat_logits(loaded.model, prompts)
    slots.batch.meta = None
    for i, ref in enumerate(refs):
        assert_parity(ours[i], ref, tol)
        assert (ours[i] - flat_logits(loaded.model, [prompts[i]])[0]).abs().max() > 1e-2, "the adapter must matter"
    alone = flat_logits(loaded.model, [prompts[-1]])[0]
    assert torch.equal(ours[-1], alone), "the base row in a LoRA batch is the base model's, bit for bit"


def test_tiny_safetensors_llama_matches_peft(tmp_path):
    path, _ = save_tiny_hf(tmp_path, "llama")
    _check_against_peft(path, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.float16])
def test_embedded_gguf_matches_peft(smol_path, tmp_path, slot_dtype):
    """float16 is what --lora-dtype auto gives over the GGUF blocks, against PEFT's float32 adapters: each weight
    rounded to 11 significant bits (2^-12 relative at most). These test adapters move the logits far more than
    trained ones do (B ~ N(0, B_STD)), and came out at 1.5e-4 of the largest logit; the float32 slots' bound stays."""
    _check_against_peft(smol_path, tmp_path, prompts_len=(5, 21, 12), slot_dtype=slot_dtype,
                        tol=TOL if slot_dtype == torch.float32 else 5e-4)


# -- the engine: mixed batches, slots, prefix caching -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_mixed_batch_of_four_adapters_and_base_equals_each_alone(smol_path, tmp_path, quantization):
    """Over the float base and the GGUF blocks (whose int8 activations would amplify any last-bit difference): each
    row's LoRA delta is summed in a fixed order whatever shares its step (csrc/lora_delta.cpp), in the module loop
    and in the native decode stack alike."""
    specs = [(8, ("q_proj", "v_proj")), (16, ("gate_proj", "up_proj", "down_proj")), (8, ("o_proj", "k_proj")),
             (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))]
    modules = tuple((f"a{i}", str(make_peft_adapter(tmp_path / f"a{i}", smol_path, rank=r, target_modules=t,
                                                    seed=10 + i))) for i, (r, t) in enumerate(specs))
    engine = LLMEngine(EngineConfig(model=str(smol_path), dtype="float32", quantization=quantization, num_threads=2,
                                    cache=CacheConfig(num_blocks=128),
                                    lora=LoraConfig(modules, max_loras=4, max_cpu_loras=4, max_lora_rank=16)))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = "The capital of France is"
    names = ["a0", "a1", None, "a2", "a3", None]

    def run(which: list[int]) -> tuple[dict[str, list[int]], dict[str, float]]:
        tokens: dict[str, list[int]] = {}
        logprob: dict[str, float] = {}  # of the whole greedy continuation: it shows the adapter even where tokens agree
        for i in which:
            lora = engine.loras.get(names[i]) if names[i] else None
            engine.add_request(f"r{i}", prompt, params, lora=lora)
        while engine.has_unfinished():
            for d in engine.step():
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
                if d.finished:
                    logprob[d.request_id] = d.cumulative_logprob
        return tokens, logprob

    alone_tokens, alone_lp = {}, {}
    for i in range(len(names)):
        t, lp = run([i])
        alone_tokens.update(t)
        alone_lp.update(lp)
    together_tokens, together_lp = run(list(range(len(names))))
    assert together_tokens == alone_tokens
    assert together_lp == pytest.approx(alone_lp, abs=1e-3)
    base_lp = alone_lp["r2"]
    assert alone_lp["r5"] == base_lp
    assert all(abs(alone_lp[f"r{i}"] - base_lp) > 1e-2 for i in (0, 1, 3, 4)), "each adapter must change the output"
    assert engine.kv.num_free_blocks == engine.num_blocks


@pytest.fixture(scope="module")
def tiny_engine_parts(tmp_path_factory):
    """A tiny random Llama checkpoint (with a tokenizer) and two PEFT adapters for it."""
    root = tmp_path_factory.mktemp("tiny_lora")
    model = tiny_llama_checkpoint(root)
    a = make_peft_adapter(root / "a", model, rank=8, target_modules=("q_proj", "v_proj"), seed=1)
    b = make_peft_adapter(root / "b", model, rank=4, target_modules=("down_proj",), seed=2)
    return model, (("a", str(a)), ("b", str(b)))


def _tiny_engine(parts, max_loras: int, quantization: str | None = None, lora_dtype: str = "auto") -> LLMEngine:
    model, modules = parts
    return LLMEngine(EngineConfig(model=str(model), num_threads=1, cache=CacheConfig(num_blocks=64, block_size=4),
                                  quantization=quantization,
                                  lora=LoraConfig(modules, max_loras=max_loras, max_cpu_loras=2, max_lora_rank=8,
                                                  dtype=lora_dtype)))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_a_quantized_base_keep_it_quantized(tiny_engine_parts, quantization):
    """The delta runs beside the int8/int4 matmul: the quantized layers stay, and the adapter's effect is the
    float model's (same adapter, same prompt) within quantization error."""
    def logprobs(engine: LLMEngine, lora_name: str | None) -> list[float]:
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
        engine.add_request("r", "w5 w6 w7 w8 w9", params, lora=engine.loras.get(lora_name) if lora_name else None)
        out = []
        while engine.has_unfinished():
            out += [lp for d in engine.step() for lp in (d.logprobs or [])]
        return out[0].top

    quant = _tiny_engine(tiny_engine_parts, 1, quantization)
    kinds = {type(m.base).__name__ for m in quant.lora_slots.wrappers}
    assert kinds == {"Int8Linear" if quantization == "int8" else "Int4Linear"}
    # --lora-dtype auto over a quantized CPU base (float32 where the build widens float16 one value at a time)
    assert quant.lora_slots.lora_dtype == (torch.float16 if widens_half_fast() else torch.float32)
    flt = _tiny_engine(tiny_engine_parts, 1)
    assert flt.lora_slots.lora_dtype == torch.float32
    q_base, q_lora, f_lora = logprobs(quant, None), logprobs(quant, "a"), logprobs(flt, "a")
    assert q_lora != q_base
    # int4 of this random checkpoint alone moves a logprob by ~0.2 (0.17 measured here)
    assert q_lora[0][0] == f_lora[0][0] and abs(q_lora[0][1] - f_lora[0][1]) < 0.4



def test_float16_slots_refuse_an_adapter_past_their_range(tiny_engine_parts, tmp_path):
    """An adapter whose B x scaling goes past float16's largest value is refused by float16 slots, naming the flag that
    serves it, never saturated; float32 slots serve it."""
    model, _ = tiny_engine_parts
    huge = make_peft_adapter(tmp_path / "huge", model, rank=4, target_modules=("q_proj",), seed=5, alpha=1e9)
    parts = (model, (("huge", str(huge)),))
    with pytest.raises(ConfigError, match="--lora-modules huge: .*--lora-dtype float32"):
        _tiny_engine(parts, 1, "int8", lora_dtype="float16")
    engine = _tiny_engine(parts, 1, "int8", lora_dtype="float32")
    assert engine.lora_slots.lora_dtype == torch.float32 and engine.loras.get("huge") is not None
    # a weight that is not finite is refused whatever the slots' type
    from safetensors.torch import load_file, save_file

    weights = huge / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    next(t for name, t in tensors.items() if "lora_A" in name)[0, 0] = float("nan")
    save_file(tensors, str(weights))
    with pytest.raises(ConfigError, match="not all finite"):
        _tiny_engine(parts, 1, "int8", lora_dtype="float32")


def test_request_waits_for_a_slot_while_base_and_others_go_ahead(tiny_engine_parts):
    engine = _tiny_engine(tiny_engine_parts, max_loras=1)
    a, b = engine.loras.get("a"), engine.loras.get("b")
    engine.add_request("ra", "w5 w6 w7", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), lora=a)
    engine.add_request("rb", "w5 w6 w7", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), lora=b)
    engine.add_request("rbase", "w5 w6 w7", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()
    running = [r.request_id for r in engine.scheduler.running]
    assert running == ["ra", "rbase"] and [r.request_id for r in engine.scheduler.waiting] == ["rb"]
    assert engine.lora_slots.slot_names == ["a"]
    while "ra" in engine.scheduler.requests:
        engine.step()
    engine.step()  # a's slot is free now: b takes it
    assert engine.lora_slots.slot_names == ["b"] and "rb" in [r.request_id for r in engine.scheduler.running]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.num_blocks


def test_prefix_cache_blocks_never_cross_adapters(tiny_engine_parts):
    engine = _tiny_engine(tiny_engine_parts, max_loras=2)
    prompt = " ".join(f"w{i}" for i in range(10, 23))  # 13 tokens: three full blocks of 4
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def hits_after(rid: str, lora: LoRARequest | None) -> int:
        before = engine.kv.prefix_hits
        engine.add_request(rid, prompt, params, lora=lora)
        while engine.has_unfinished():
            engine.step()
        return engine.kv.prefix_hits - before

    a, b = engine.loras.get("a"), engine.loras.get("b")
    assert hits_after("1", a) == 0
    assert hits_after("2", b) == 0, "adapter b must not reuse adapter a's blocks"
    assert hits_after("3", None) == 0, "the base model must not reuse an adapter's blocks"
    assert hits_after("4", a) == 12
    assert hits_after("5", None) == 12


def test_host_cache_keeps_max_cpu_loras_and_rereads(tiny_engine_parts, tmp_path):
    engine = _tiny_engine(tiny_engine_parts, max_loras=1)
    reg = engine.loras
    loads = reg.num_loads
    c = reg.register("c", tiny_engine_parts[1][0][1])  # a third adapter: the LRU (2) drops the oldest
    assert reg.num_evictions == 1 and len(reg.cached_ids()) == 2 and c.lora_int_id not in (1, 2)
    first = reg.registrations()[0].name
    assert reg.get(first) is not None and reg.num_loads == loads + 2  # evicted: read again from disk
    assert reg.unregister("c") and reg.get("c") is None
