"""The real engine and runner with `--attention-backend triton`, on CPU tensors under Triton's interpreter.

A tiny random Llama (3 layers, 8 heads over 2 KV heads, head_dim 16; blocks of 8 tokens) runs the same
requests through the Triton backend and the reference backend (gather + SDPA): the greedy tokens must be the
same and every chosen token's logprob within 1e-3. The scenarios cover whole prompts, chunked prefill (a chunk
after the request's own earlier chunks), steps that mix decodes with a prefill chunk, an asserted prefix-cache
hit (a prompt's cached blocks, then its new tokens as one extend chunk), and the fixed-shape decode path that
CUDA graphs capture (padded to a batch-size bucket, the full-width block table: split-K with a merge).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lmserve.cache.sizing import blocks_for  # noqa: E402
from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.errors import ConfigError  # noqa: E402
from lmserve.layers.attention.backends import resolve_attention_backend  # noqa: E402
from lmserve.layers.kernels.triton.backend import TritonPagedAttention  # noqa: E402
from lmserve.layers.kernels.triton.decode import num_kv_splits  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import KV_HEADS, write_tiny_llama  # noqa: E402
from tests.test_engine import assert_no_leak  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; tests/test_cuda.py covers CUDA")

BLOCK = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton-runner") / "tiny"
    write_tiny_llama(path)
    return engine(None, "reference", model=str(path))


def engine(base: LLMEngine | None, backend: str, model: str | None = None, **sched) -> LLMEngine:
    cfg = EngineConfig(model=model or base.cfg.model, dtype="float32", attention_backend=backend,
                       cache=CacheConfig(num_blocks=96, block_size=BLOCK), scheduler=SchedulerConfig(**sched))
    if base is None:
        return LLMEngine(cfg)
    return LLMEngine(cfg, loaded=base.loaded, tokenizer=base.tokenizer)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(eng: LLMEngine, prompts: list[list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs per request; every step's (decode rows, prefill tokens) recorded."""
    out = {str(i): ([], []) for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, PARAMS)
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id][0].extend(d.token_ids)
            out[d.request_id][1].extend(lp.logprob for lp in d.logprobs or [])
    return out


def record_steps(eng: LLMEngine) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    real = eng.runner.execute

    def execute(out):
        result = real(out)
        seen.append((result.num_decodes, result.num_prefill_tokens))
        return result

    eng.runner.execute = execute
    return seen


def assert_same(out: dict, ref: dict) -> None:
    assert {k: v[0] for k, v in out.items()} == {k: v[0] for k, v in ref.items()}
    for k in ref:
        assert len(out[k][1]) == len(ref[k][1]) == PARAMS.max_tokens
        diff = max(abs(a - b) for a, b in zip(out[k][1], ref[k][1]))
        assert diff <= 1e-3, f"request {k}: logprobs differ by {diff:.2e}"


def test_the_runner_attends_through_the_triton_kernels(reference):
    eng = engine(reference, "triton")
    assert eng.runner.attention is TritonPagedAttention
    assert reference.runner.attention is not TritonPagedAttention


def test_whole_prompts_chunked_prefill_and_mixed_steps(reference):
    """Budget 16: the 40-token prompt runs in three chunks, the short ones are admitted beside its last chunk and
    then decode while the 9-token prompt's second chunk prefills."""
    prompts = [prompt(40, 1), prompt(3, 2), prompt(9, 3)]
    ref = run(engine(reference, "reference", max_num_batched_tokens=16), prompts)
    eng = engine(reference, "triton", max_num_batched_tokens=16)
    steps = record_steps(eng)
    assert_same(run(eng, prompts), ref)
    assert steps[0] == (0, 16) and steps[1] == (0, 16)  # chunks of the long prompt, the second after the first
    assert any(d > 0 and p > 0 for d, p in steps), steps  # a mixed step
    whole = [prompt(5, 4), prompt(17, 5), prompt(30, 6)]  # a roomy budget: each prompt in one chunk, together
    ref_whole = run(engine(reference, "reference"), whole)
    big = engine(reference, "triton")
    steps = record_steps(big)
    assert_same(run(big, whole), ref_whole)
    assert steps[0] == (0, 52)
    assert_no_leak(eng)
    assert_no_leak(big)


def test_prefix_cache_hit_then_extend(reference):
    shared = prompt(27, 7)
    prompts = [shared, shared + prompt(6, 8)]
    ref = {}
    ref_eng = engine(reference, "reference")
    for i, p in enumerate(prompts):
        ref[str(i)] = run(ref_eng, [p])["0"]
    eng = engine(reference, "triton")
    out = {"0": run(eng, [prompts[0]])["0"]}
    hits = eng.kv.prefix_hits
    out["1"] = run(eng, [prompts[1]])["0"]
    assert eng.kv.prefix_hits - hits == 3 * BLOCK  # the 3 full blocks of the shared 27 tokens came from the cache
    assert_same(out, ref)
    assert_no_leak(eng)


def test_fixed_shape_decode_path_that_cuda_graphs_capture(reference):
    """Three requests in a bucket of 4 (one padding row writing the scratch block), the table at its full width:
    512 keys over 4 rows and 2 KV heads is two split-K ranges, merged."""
    prompts = [prompt(6, 9), prompt(11, 10), prompt(19, 11)]
    ref = run(engine(reference, "reference"), prompts)
    eng = engine(reference, "triton")
    width = blocks_for(eng.max_model_len, eng.block_size)
    eng.runner.enable_decode_graphs(4, width, capture=False)
    assert num_kv_splits(4, KV_HEADS, width * BLOCK) == 2
    seen: list[int] = []
    real = eng.runner.graphs.run
    eng.runner.graphs.run = lambda inputs: seen.append(len(inputs.input_ids)) or real(inputs)
    assert_same(run(eng, prompts), ref)
    assert seen and 3 in seen, seen
    assert_no_leak(eng)


def test_backend_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention_backend("auto", cpu, torch.float32).name == "reference"  # the CPU keeps its kernel
    assert resolve_attention_backend("reference", cpu, torch.float32).name == "reference"
    assert resolve_attention_backend("triton", cpu, torch.float32).name == "triton"  # the interpreter is on
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="need a CUDA GPU"):
        resolve_attention_backend("triton", cpu, torch.float32)
    with pytest.raises(ConfigError, match="must be one of"):
        resolve_attention_backend("flash", cuda, torch.bfloat16)


def test_flags_reach_the_config_and_a_wrong_backend_stops_before_loading(monkeypatch):
    from lmserve.cli import build_parser
    from lmserve.config import engine_config
    from lmserve.preflight import check_engine_config

    cfg = engine_config(build_parser().parse_args(["serve", "--attention-backend", "triton", "--enforce-eager"]))
    assert cfg.attention_backend == "triton" and cfg.enforce_eager
    default = engine_config(build_parser().parse_args(["serve"]))
    # CUDA graphs are on by default since they were measured on an H100 (5-10x eager); CPU runs ignore them
    assert default.attention_backend == "auto" and not default.enforce_eager and default.cuda_graphs
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="--attention-backend triton: its kernels need a CUDA GPU"):
        check_engine_config(cfg)


def test_gpu_benchmark_exits_2_without_a_gpu(tmp_path):
    """benchmarks/gpu.py measures on a CUDA GPU only: here it says so, exits 2 and writes nothing."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(script), "--output", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU here" in proc.stderr and not out.exists()


def test_a_moe_model_runs_its_experts_through_the_triton_kernels(tmp_path):
    """A tiny Qwen3-MoE (8 experts, top-2) under the Triton backend: the moe_kernels step gives every MoE layer the
    fused Triton experts (the reference backend's runner gives them the native CPU kernels), and the greedy tokens and
    logprobs equal the reference engine's. The Triton engine's model keeps plain float linears, as on CUDA (the CPU's
    oneDNN packing is for the CPU kernels)."""
    from lmserve.layers.kernels.moe_kernels import NativeExperts
    from lmserve.layers.kernels.triton.moe import TritonExperts
    from lmserve.worker.transforms import load_formatted
    from tests.tiny_models import build_hf

    path, _ = build_hf("qwen3_moe", tmp_path)
    ref = engine(None, "reference", model=str(path))
    plain = load_formatted(path, torch.float32, torch.device("cpu"), pack=False)
    cfg = EngineConfig(model=str(path), dtype="float32", attention_backend="triton",
                       cache=CacheConfig(num_blocks=96, block_size=BLOCK))
    tri = LLMEngine(cfg, loaded=plain, tokenizer=ref.tokenizer)
    layers = [layer.mlp for layer in tri.runner.model.model.layers]
    assert tri.runner.moe_layers == len(layers) and all(isinstance(m.grouped, TritonExperts) for m in layers)
    assert all(isinstance(layer.mlp.grouped, NativeExperts) for layer in ref.runner.model.model.layers)
    prompts = [prompt(11, 1), prompt(4, 2), prompt(19, 3)]
    assert_same(run(tri, prompts), run(ref, prompts))
