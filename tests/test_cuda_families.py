"""The CUDA path beyond tests/test_cuda.py's tiny Llama: every decoder family of tests/tiny_models.py, the vision
families, an embedder and a reranker, and multi-LoRA, each on the GPU with CUDA's defaults (the Triton attention
backend, CUDA graphs where the engine takes them) against the same engine on the CPU. Skipped without CUDA.

Greedy tokens must match, and the first token's logprob (or each vector) within float32 tolerance: the GPU's
float32 kernels add in another order, so a near-tie may turn once in a family's prompts (tests/test_cuda.py's rule).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmserve.config import CacheConfig, EngineConfig, LoraConfig
from lmserve.engine.llm import LLM
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams
from tests.test_cuda import assert_agree, family_engines, greedy_with_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")

# tests/test_cuda.py runs gemma3 and qwen3_moe with their own checks (graphs replayed, six KV groups)
FAMILIES = ["llama", "qwen3", "mistral", "gemma2", "phi3", "smollm3", "mixtral", "qwen2_moe", "gpt_oss"]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_on_cuda_equals_the_cpu_engine(tmp_path, name):
    cpu, gpu, prompts = family_engines(tmp_path, name, 7, (41, 6, 19, 1, 30), num_blocks=96)
    ref, out = greedy_with_logprobs(cpu, prompts), greedy_with_logprobs(gpu, prompts)
    assert_agree(ref, out)
    alone = {str(i): greedy_with_logprobs(gpu, [p])["0"][0] for i, p in enumerate(prompts)}
    assert alone == {k: v[0] for k, v in out.items()}, "a request's tokens in a batch == alone"
    assert gpu.kv.req_blocks == {} and gpu.kv.num_free_blocks == gpu.num_blocks


VISION = ["idefics3", "llava", "gemma3", "qwen25_vl"]


@pytest.mark.parametrize("name", VISION)
def test_vision_family_on_cuda_equals_the_cpu_engine(tmp_path, name):
    """Images through the CUDA engine (the tower on the GPU, its embeddings spliced into chunked prompts) give the
    CPU engine's greedy tokens; a mixed text and image batch gives each what it gets alone."""
    from tests import vision_models as vm

    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = getattr(vm, f"build_{name}")(tmp_path)
    tag = {"idefics3": "<image>", "llava": "<image>", "gemma3": "<start_of_image>",
           "qwen25_vl": "<|vision_start|><|image_pad|><|vision_end|>"}[name]
    a, b = vm.image(90, 50, seed=11), vm.image(56, 84, seed=12)
    prompts = [{"prompt": f"w3 w4 {tag} w5 w6", "multi_modal_data": {"image": [a]}},
               {"prompt": "w1 w2 w3 w4 w5"},
               {"prompt": f"w7 {tag} w8 {tag} w9", "multi_modal_data": {"image": [b, a]}}]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)

    def tokens(llm: LLM, batch: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
        return {str(i): (o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs])
                for i, o in enumerate(llm.generate(batch, greedy, use_tqdm=False))}

    kw = dict(dtype="float32", mm_encoder_dtype="float32", num_blocks=128, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8)
    ref = tokens(LLM(str(path), device="cpu", **kw), prompts)
    gpu = LLM(str(path), device="cuda", **kw)
    got = tokens(gpu, prompts)
    assert_agree(ref, got)  # each prompt's first token's logprob: an image spliced wrongly moves it far
    assert [tokens(gpu, [p])["0"][0] for p in prompts] == [v[0] for v in got.values()]
    kv = gpu.engine.kv
    assert kv.num_free_blocks == gpu.engine.num_blocks


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_embedder_and_reranker_on_cuda_equal_the_cpu(tmp_path, kind):
    from tests.encoder_models import SENTENCES, build_encoder

    emb = build_encoder(tmp_path / "emb", kind, pooling="mean", normalize=True)
    vectors = [np.array([o.outputs.embedding for o in LLM(str(emb), device=d, dtype="float32").embed(
        SENTENCES, use_tqdm=False)]) for d in ("cpu", "cuda")]
    assert np.abs(vectors[0] - vectors[1]).max() < 1e-4
    ce = build_encoder(tmp_path / "ce", kind, num_labels=1, pooling=None)
    pairs = [(q, d) for q in SENTENCES[:2] for d in SENTENCES]
    scores = []
    for d in ("cpu", "cuda"):
        llm = LLM(str(ce), device=d, dtype="float32")
        scores.append(np.array([o.outputs.embedding for o in llm.embed(
            [llm.tokenizer.encode_pair(q, t) for q, t in pairs], use_tqdm=False)])[:, 0])
    assert np.abs(scores[0] - scores[1]).max() < 1e-4


def test_multi_lora_batch_on_cuda_equals_the_cpu(tmp_path):
    """Two adapters and the base in one CUDA batch: each request's greedy tokens equal the CPU engine's and its own
    alone; the adapters change the answer."""
    from tests.lora_adapters import make_peft_adapter, tiny_llama_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama_checkpoint(tmp_path)
    a = make_peft_adapter(tmp_path / "a", model, rank=8, target_modules=("q_proj", "v_proj"), seed=1)
    b = make_peft_adapter(tmp_path / "b", model, rank=4, target_modules=("down_proj",), seed=2)

    def engine(device: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model), device=device, dtype="float32", quantization="none",
                                      cache=CacheConfig(num_blocks=64, block_size=16),
                                      lora=LoraConfig((("a", str(a)), ("b", str(b))), max_loras=2,
                                                      max_lora_rank=8)))

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (12, 5, 20)]
    prompts.insert(2, prompts[0])  # the first prompt again, on the base model
    names = ["a", "b", None, "b"]
    cpu, gpu = engine("cpu"), engine("cuda")
    ref = greedy_with_logprobs(cpu, prompts, [cpu.loras.get(n) if n else None for n in names])
    got = greedy_with_logprobs(gpu, prompts, [gpu.loras.get(n) if n else None for n in names])
    assert_agree(ref, got)
    assert ref["0"][0] != ref["2"][0], "the adapter must change the answer"
    alone = greedy_with_logprobs(gpu, [prompts[0]], [gpu.loras.get("a")])["0"]
    assert alone[0] == got["0"][0]
    assert gpu.kv.num_free_blocks == gpu.num_blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import write_tiny_llama

    path = tmp_path_factory.mktemp("cuda_features") / "tiny-llama"
    write_tiny_llama(path)
    return path


def _llm(tiny, device: str, **kw) -> LLM:
    return LLM(str(tiny), device=device, dtype="float32", num_blocks=96, block_size=16, **kw)


def _outs(llm: LLM, prompts, params) -> list[tuple[list[int], str, list[float] | None]]:
    """Per completion: its tokens, text, and every logprob it carries as one list (each generated token's, then its
    alternatives' ids and logprobs, then the prompt's with theirs), or None without logprobs."""
    def flat(entries) -> list[float]:
        return [x for t in entries if t is not None for x in (t.token_id, t.logprob, *(v for pair in t.top for v in pair))]

    return [(o.token_ids, o.text, flat(o.logprobs) + flat(r.prompt_logprobs or []) if o.logprobs else None)
            for r in llm.generate(prompts, params, use_tqdm=False) for o in r.outputs]


def test_speculative_decoding_on_cuda_equals_plain_greedy(tiny):
    """ngram and draft-model speculation on the GPU (the draft the target itself, so every draft is accepted) give
    plain greedy decoding's tokens; drafts were really verified. (The random model seldom continues the loop: the
    ngram drafts may all be rejected, and the policy then stops drafting; seen on an H200.)"""
    torch.backends.cuda.matmul.allow_tf32 = False
    loop = " ".join(f"w{i}" for i in range(20, 36))
    prompts = [f"{loop} {loop} {loop} w20 w21", "w5 w6 w7 w8 w9", f"w40 {loop} w41 {loop}"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _outs(_llm(tiny, "cuda"), prompts, greedy)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 3}):
        llm = _llm(tiny, "cuda", speculative_config=spec)
        assert _outs(llm, prompts, greedy) == plain, spec["method"]
        stats = llm.engine.spec_stats
        assert stats.num_draft_tokens > 0, spec["method"]  # drafts were proposed and verified
        if spec["method"] == "draft_model":  # the target as its own draft: every draft is its own greedy token
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_sampling_controls_on_cuda_equal_the_cpu(tiny):
    """Penalties, logit bias, min_tokens, logprobs and prompt logprobs, greedy: the GPU's sampler gives the CPU's
    tokens and logprobs (float32 tolerance). (Grammars need a real tokenizer's pieces: this one's words are not.)"""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = "w3 w9 w27 w81 w3 w9 w27"
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5,
                             presence_penalty=0.4, logprobs=0, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={7: 30.0, 8: -100.0}),
              SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=[9, 10])]
    cpu, gpu = _outs(_llm(tiny, "cpu"), [prompt] * len(params), params), _outs(_llm(tiny, "cuda"),
                                                                             [prompt] * len(params), params)
    for (ids_c, text_c, lp_c), (ids_g, text_g, lp_g) in zip(cpu, gpu):
        assert (ids_g, text_g) == (ids_c, text_c)
        assert (lp_c is None) == (lp_g is None) and (lp_c is None or np.allclose(lp_c, lp_g, atol=1e-3))
    assert cpu[2][0][0] == 7
