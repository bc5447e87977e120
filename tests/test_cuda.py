"""The CUDA path: the same engine on a GPU gives the CPU's logits and greedy tokens. Skipped without CUDA.

The checkpoint is a tiny random Llama written here with safetensors and a WordLevel tokenizer.json
(no transformers, no download), so the test runs on a bare GPU machine with only lmserve's own deps.
"""

from __future__ import annotations

import pytest
import torch

from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.sampling_params import SamplingParams
from lmserve.worker.transforms import load_formatted
from tests.conftest import VOCAB, write_tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda") / "tiny-llama"
    write_tiny_llama(path)
    return path


def logits(model, prompts: list[list[int]], device: str) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    pos = torch.cat([torch.arange(len(p)) for p in prompts]).to(device)
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos, ContiguousAttention([len(p) for p in prompts]))).cpu()


def test_cuda_logits_equal_cpu_logits(tiny):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 40, 200)]
    cpu = load_formatted(tiny, torch.float32, torch.device("cpu"))
    gpu = load_formatted(tiny, torch.float32, torch.device("cuda"))
    assert next(gpu.model.parameters()).device.type == "cuda"
    ref, out = logits(cpu.model, prompts, "cpu"), logits(gpu.model, prompts, "cuda")
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-4
    bf = load_formatted(tiny, torch.bfloat16, torch.device("cuda"))
    low = logits(bf.model, prompts, "cuda").float()
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.token_ids
    return out


def engine_on(tiny, device: str, num_blocks: int = 256, eager: bool = False) -> LLMEngine:
    """The engine with its defaults (CUDA graphs on for decode on CUDA), or `eager` (--enforce-eager)."""
    return LLMEngine(EngineConfig(model=str(tiny), device=device, dtype="float32", enforce_eager=eager,
                                  cache=CacheConfig(num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def test_cuda_engine_greedy_equals_cpu_batched_chunked_and_preempted(tiny):
    """Greedy tokens on the GPU == on the CPU, alone == in a batch, with chunked prefill and preemption; no leaks."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 70, 17, 130, 1, 33, 90, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cpu = run(engine_on(tiny, "cpu"), prompts, params)
    gpu = engine_on(tiny, "cuda")
    assert gpu.runner.kv_caches[0].device.type == "cuda"
    alone = {str(i): run(gpu, [p], params)["0"] for i, p in enumerate(prompts)}
    batched = run(gpu, prompts, params)
    assert batched == alone
    # small pool: preemption must happen, tokens stay the same
    small = engine_on(tiny, "cuda", num_blocks=12)
    preempted = run(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert preempted == batched
    for eng in (gpu, small):
        assert eng.kv.num_free_blocks == eng.num_blocks
    # a float32 GPU and the CPU may differ at a near-tie; on this seeded model they agree
    assert sum(cpu[k] == batched[k] for k in cpu) >= len(prompts) - 1


def test_cuda_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    gpu = engine_on(tiny, "cuda")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    one = run(gpu, [[5, 6, 7, 8]], params)["0"]
    many = run(gpu, [[5, 6, 7, 8], [9, 10], [11, 12, 13]], params)["0"]
    assert one == many and len(one) == 12


def test_cuda_server_streams_the_engines_tokens(tiny):
    """`lmserve serve --device cuda` through the official openai client: greedy text == the CUDA engine's, streamed
    or not, and every KV block back afterwards."""
    import openai

    from tests.server_util import running_server

    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[5, 6, 7, 8, 9], list(range(10, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng = engine_on(tiny, "cuda")
    want = []
    for i, p in enumerate(prompts):  # the engine's streamed text (continuation spacing included)
        eng.add_request(str(i), p, params)
        want.append("".join(d.text for _ in iter(eng.has_unfinished, False) for d in eng.step()))
    with running_server("--model", str(tiny), "--device", "cuda", "--dtype", "float32") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        for prompt, text in zip(prompts, want):
            got = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == text and got.usage.completion_tokens == 10
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert srv.metric("lmserve:model_info", 'dtype="float32"') == 1
        srv.wait_idle()


def test_cuda_int4_and_int8_layers_equal_the_cpu_layers():
    """The same float weights quantized on CUDA and on CPU give the same layer output (bf16 rounding apart)."""
    from torch import nn

    from lmserve.layers.formats.quantized import Int4Linear, Int8Linear

    torch.manual_seed(5)
    lin = nn.Linear(256, 96)
    x = torch.randn(7, 256)
    for cls in (Int4Linear, Int8Linear):
        ref = cls(lin)(x)
        out = cls(_cuda_copy(lin))(x.cuda()).cpu()
        assert out.dtype == torch.float32
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2, cls.__name__


def _cuda_copy(lin):
    from torch import nn

    copy = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None).cuda()
    copy.load_state_dict(lin.state_dict())
    return copy


def test_cuda_int4_engine_batch_equals_alone(tiny):
    """--quantization int4 on CUDA: greedy alone == batched, blocks returned, logits == the CPU int4 model's."""
    from lmserve.layers.formats.quantized import Int4Linear

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 40, 11, 90)]
    eng = LLMEngine(EngineConfig(model=str(tiny), device="cuda", dtype="float32", quantization="int4",
                                 cache=CacheConfig(num_blocks=128)))
    assert isinstance(eng.loaded.model.model.layers[0].mlp.gate_up_proj, Int4Linear)
    alone = {str(i): run(eng, [p], params)["0"] for i, p in enumerate(prompts)}
    assert run(eng, prompts, params) == alone
    assert eng.kv.num_free_blocks == eng.num_blocks
    # the same int4 codes on both devices: only bf16 rounding inside the kernels differs
    cpu = load_formatted(tiny, torch.float32, torch.device("cpu"), quantization="int4")
    a, b = logits(eng.loaded.model, prompts, "cuda"), logits(cpu.model, prompts, "cpu")
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item() > 0.999
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.95


def test_cuda_graph_replay_equals_eager(tiny):
    """--cuda-graphs: decode steps replayed from captured graphs give the eager engine's greedy tokens, batched
    (7 rows: a bucket of 8 with padding) and with sequences crossing 16-token block boundaries inside a
    captured batch; every bucket was captured and replayed; no KV block leaks."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 14, 15, 31, 1, 47, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eager = run(engine_on(tiny, "cuda", eager=True), prompts, params)
    eng = LLMEngine(EngineConfig(model=str(tiny), device="cuda", dtype="float32", cuda_graphs=True,
                                 cache=CacheConfig(num_blocks=256),
                                 scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    graphs = eng.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.capture_seconds > 0
    replays: list[int] = []
    real = graphs.run
    graphs.run = lambda inputs: replays.append(len(inputs.input_ids)) or real(inputs)
    assert run(eng, prompts, params) == eager
    assert 7 in replays
    alone = {str(i): run(eng, [p], params)["0"] for i, p in enumerate(prompts)}
    assert alone == eager and 1 in replays
    assert eng.kv.num_free_blocks == eng.num_blocks


def greedy_with_logprobs(engine: LLMEngine, prompts: list[list[int]],
                         loras: list | None = None) -> dict[str, tuple[list[int], list[float]]]:
    """Each prompt's 12 greedy tokens and their logprobs, all in one batch (`loras`: each prompt's adapter or None)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, **({"lora": loras[i]} if loras else {}))
    out: dict[str, tuple[list[int], list[float]]] = {str(i): ([], []) for i in range(len(prompts))}
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id][0].extend(d.token_ids)
            out[d.request_id][1].extend(lp.logprob for lp in d.logprobs)
    return out


def assert_agree(ref: dict, got: dict, tol: float = 1e-3) -> None:
    """GPU against CPU, {id: (tokens, logprobs)}: the same greedy tokens (a float32 near-tie may turn once) and each
    first token's logprob within `tol`."""
    assert sum(got[k][0] == ref[k][0] for k in ref) >= len(ref) - 1, (ref, got)
    for k in ref:
        assert got[k][1][0] == pytest.approx(ref[k][1][0], abs=tol), k


def family_engines(tmp_path, name: str, seed: int, lens: tuple[int, ...], num_blocks: int):
    """(CPU engine, CUDA engine, random prompts of `lens` tokens) for tests/tiny_models.py's `name`, float32 with each
    device's defaults (tf32 off), the prompts prefilled in 24-token chunks; the GPU's attention is Triton's."""
    from lmserve.layers.kernels.triton.backend import TritonPagedAttention
    from tests.tiny_models import build_hf

    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = build_hf(name, tmp_path)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
    cpu, gpu = (LLMEngine(EngineConfig(model=str(path), device=device, dtype="float32", quantization="none",
                                       cache=CacheConfig(num_blocks=num_blocks, block_size=16),
                                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24)))
                for device in ("cpu", "cuda"))
    assert gpu.runner.attention is TritonPagedAttention
    return cpu, gpu, prompts


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3"])
def test_cuda_moe_and_sliding_window_engines_equal_the_cpu_engine(tmp_path, name):
    """A tiny Qwen3-MoE (8 experts, top-2) and a tiny Gemma 3 (5 window layers : 1 global, window 8, in six KV groups)
    with CUDA's defaults (the Triton backend: the MoE's experts in the fused Triton kernels, its decode steps replayed
    from CUDA graphs; Gemma's several KV groups decode eagerly) give the CPU engine's greedy tokens, their first
    token's logprob within float tolerance, over chunked prompts longer than the window; no KV block leaks."""
    from lmserve.layers.kernels.triton.moe import TritonExperts

    cpu, gpu, prompts = family_engines(tmp_path, name, 6, (37, 5, 23, 30, 1), num_blocks=128)
    replays: list[int] = []
    if name == "qwen3_moe":
        layers = [layer.mlp for layer in gpu.runner.model.model.layers]
        assert gpu.runner.moe_layers == len(layers) and all(isinstance(m.grouped, TritonExperts) for m in layers)
        graphs = gpu.runner.graphs
        assert graphs is not None and graphs.capture_seconds > 0
        real = graphs.run
        graphs.run = lambda inputs: replays.append(len(inputs.input_ids)) or real(inputs)
    else:
        assert len(gpu.kv.groups) == 6 and gpu.runner.graphs is None
    assert_agree(greedy_with_logprobs(cpu, prompts), greedy_with_logprobs(gpu, prompts))
    assert replays or name != "qwen3_moe"
    assert gpu.kv.req_blocks == {} and gpu.kv.num_free_blocks == gpu.num_blocks
