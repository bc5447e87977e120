"""Every architecture lmserve serves, as a tiny random-weight model made by transformers (tests/tiny_models.py):
saved as safetensors and written as GGUF the way llama.cpp's converter writes it, loaded by lmserve, and
compared with transformers in float32: logits within 1e-4 of the largest, and 32 greedy tokens identical on
8 prompts through the engine, with chunked prefill and prompts that share a cached prefix. The tiny configs
make what sets each family apart matter: windows of 8-24 tokens, strong soft-caps, random norm weights."""

from __future__ import annotations

import pytest
import torch

from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.layers.formats.gguf_linear import FusedGGUFLinear, GGUFLinear
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer
from lmserve.utils import KV_QUANT_DTYPES
from lmserve.worker.transforms import load_formatted
from tests.test_model_parity import flat_logits
from tests.tiny_models import ARCHS, VOCAB, build_gemma3_multimodal, build_hf, write_gguf

TOL = 1e-4
CASES = [(name, "hf") for name in [*ARCHS, "gemma3_multimodal"]] + \
        [(name, "gguf") for name, arch in ARCHS.items() if arch.gguf]
PARITY_LENS = (1, 7, 19, 30, 45)  # past every tiny window (8, 24); Phi-3's original context is 32


@pytest.fixture(scope="module")
def reference(tiny):
    """name -> transformers' 32 greedy tokens for each GREEDY_BATCH prompt, computed once for both formats."""
    done = {}

    def get(name: str) -> list[list[int]]:
        if name not in done:
            done[name] = reference_greedy(tiny(name)[2], GREEDY_BATCH)
        return done[name]
    return get


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (HF directory, GGUF file or None, the transformers model), built once per module."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        if name not in built:
            path, ref = build_gemma3_multimodal(root) if name == "gemma3_multimodal" else build_hf(name, root)
            gguf = write_gguf(name, ref, root / f"{name}.gguf") if ARCHS.get(name) and ARCHS[name].gguf else None
            built[name] = (path, gguf, ref)
        return built[name]
    return get


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB - 3, (n,), generator=g).tolist() for n in lengths]


GREEDY_BATCH = [prompts([40], seed=7)[0] + p for p in prompts([3, 9, 17, 5, 12, 1, 14, 7], seed=3)]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= tol, f"max |dlogit| / max |logit| = {rel:.2e} > {tol}"


def reference_greedy(ref, batch: list[list[int]], n: int = 32) -> list[list[int]]:
    """transformers' greedy continuations, recomputing every whole sequence each step (no cache to trust), the
    sequences right-padded into one batch (causal attention: padding after a token never reaches it)."""
    seqs = [list(p) for p in batch]
    with torch.no_grad():
        for _ in range(n):
            lens = torch.tensor([len(s) for s in seqs])
            ids = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = torch.tensor(s)
            nxt = ref(ids).logits[torch.arange(len(seqs)), lens - 1].argmax(-1).tolist()
            for s, t in zip(seqs, nxt):
                s.append(t)
    return [s[len(p):] for s, p in zip(seqs, batch)]


@pytest.mark.parametrize("name,fmt", CASES)
def test_logits_match_transformers(tiny, name, fmt):
    """Every prompt length, in one flat batch, within 1e-4 of transformers' largest logit. Phi-3: prompts that fit
    its original context rotate by the short factors (served with max_model_len 32), longer ones by the long."""
    path, gguf, ref = tiny(name)
    source = path if fmt == "hf" else gguf
    loaded = load_formatted(source, torch.float32, torch.device("cpu"), quantization="none")
    short = load_formatted(source, torch.float32, torch.device("cpu"), quantization="none", max_model_len=32) \
        if name == "phi3" else loaded
    batch = prompts(PARITY_LENS)
    for prompt, ours, ours_short in zip(batch, flat_logits(loaded.model, batch), flat_logits(short.model, batch)):
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        assert_close(ours_short if len(prompt) <= 32 else ours, theirs)


@pytest.mark.parametrize("name", [n for n, a in ARCHS.items() if a.gguf])
def test_gguf_and_hf_read_the_same_model(tiny, name):
    """The two files normalise to the same ModelConfig (the norms' offset aside: llama.cpp stores 1 + w)."""
    from dataclasses import asdict

    from lmserve.loader import read_model_config

    path, gguf, _ = tiny(name)
    ignore = {"architecture", "norm_offset", "bos_token_id", "eos_token_ids", "rope_scaling"}  # no vocab in the GGUF
    hf, gg = asdict(read_model_config(path)), asdict(read_model_config(gguf))
    assert gg.pop("rms_norm_eps") == pytest.approx(hf.pop("rms_norm_eps"), rel=1e-6)  # GGUF stores a float32
    assert {k: v for k, v in hf.items() if k not in ignore} == {k: v for k, v in gg.items() if k not in ignore}
    assert hf["norm_offset"] == ARCHS[name].norm_shift and gg["norm_offset"] == 0.0


@pytest.mark.parametrize("name,fmt", [c for c in CASES if c[0] != "gemma3_multimodal"])
def test_greedy_through_the_engine_matches_transformers(tiny, reference, name, fmt):
    """8 prompts sharing a 40-token prefix (a first request puts it in the prefix cache; the other 7 reuse it),
    prefilled in chunks of at most 24 tokens, 32 greedy tokens each: identical to transformers."""
    path, gguf, _ = tiny(name)
    batch = GREEDY_BATCH
    eng = LLMEngine(EngineConfig(model=str(path if fmt == "hf" else gguf), quantization="none", dtype="float32",
                                 cache=CacheConfig(num_blocks=96, block_size=16),
                                 scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24)),
                    tokenizer=Tokenizer.from_pretrained(path))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = {str(i): [] for i in range(len(batch))}
    for wave in ([0], range(1, len(batch))):
        for i in wave:
            eng.add_request(str(i), batch[i], params)
        while eng.has_unfinished():
            for d in eng.step():
                out[d.request_id] += d.token_ids
    assert eng.kv.prefix_hits >= 7 * 32  # two full blocks of the shared prefix, for each of the 7
    assert eng.kv.num_free_blocks == eng.num_blocks
    for i, want in enumerate(reference(name)):
        assert out[str(i)] == want, f"prompt {i}"


def test_packed_gguf_keeps_mixed_layouts_quantized(tiny, tmp_path):
    """A Q4_K_M-style file (q/k Q5_0, v Q8_0, the rest Q8_0/Q4_1): the default packed path keeps every projection in
    its blocks, a qkv of two layouts as a FusedGGUFLinear, and its logits follow the dequantized float path's."""
    _, _, ref = tiny("gemma3")
    kinds = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "ffn_down": "Q4_1"}
    path = write_gguf("gemma3", ref, tmp_path / "mixed.gguf", lambda n: kinds.get(n.split(".")[-2], "Q8_0"))
    packed = load_formatted(path, torch.float32, torch.device("cpu"), quantization="gguf").model
    plain = load_formatted(path, torch.float32, torch.device("cpu"), quantization="none").model
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FusedGGUFLinear) and len(layer.self_attn.qkv_proj.parts) == 2
    assert all(type(m) is GGUFLinear for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    batch = prompts((5, 30))
    for ours, theirs in zip(flat_logits(packed, batch), flat_logits(plain, batch)):
        assert_close(ours, theirs, tol=0.03)  # int8 activations, as llama.cpp quantizes them


@pytest.mark.parametrize("name,kv_dtype", [(n, "auto") for n, a in ARCHS.items()
                                           if a.gguf and n != "phi3" and not a.moe] +
                         [("gemma2", "int8"), ("gemma3", "fp8_e4m3")])
def test_native_decode_stack_is_the_module_loop_bitwise(tiny, tmp_path, name, kv_dtype):
    """Quantized GGUFs of every family whose layers the native decode stack runs (sandwich norms, QK-norm, GeGLU,
    NoPE layers, per-kind rotary tables, windows, soft-caps; q/k and v in different block layouts): the runner
    applies it, and tokens and logprobs are bit-identical with it removed (Phi-3's partial rotary and the mixtures
    of experts keep the loop); also over quantized KV caches (Gemma 2's windows and soft-caps, Gemma 3's QK-norm and per-kind rotary)."""
    from lmserve.layers.kernels.decode_stack import apply_decode_stack, remove_decode_stack

    _, _, ref = tiny(name)
    kinds = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0"}
    path = write_gguf(name, ref, tmp_path / "q.gguf", lambda n: kinds.get(n.split(".")[-2], "Q8_0"))
    # the same cache state in both runs
    cache = CacheConfig(num_blocks=64, enable_prefix_caching=False, kv_cache_dtype=kv_dtype)
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", quantization="gguf", cache=cache,  # a CPU stack
                                 scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)),
                    tokenizer=Tokenizer.from_pretrained(tiny(name)[0]))
    assert eng.runner.decode_stack is not None
    assert kv_dtype == "auto" or eng.runner.kv_caches[0].dtype == KV_QUANT_DTYPES[kv_dtype]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)

    def run() -> dict:
        out: dict = {}
        for i, p in enumerate(GREEDY_BATCH[:3]):
            eng.add_request(str(i), p, params)
        while eng.has_unfinished():
            for d in eng.step():
                out.setdefault(d.request_id, []).extend((t.token_id, t.logprob, tuple(t.top)) for t in d.logprobs)
        return out

    fused = run()
    model = eng.loaded.model
    remove_decode_stack(model)
    assert run() == fused
    assert apply_decode_stack(model).steps == 0 and eng.runner.decode_stack.steps >= 20
