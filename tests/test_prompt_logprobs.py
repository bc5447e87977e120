"""Prompt logprobs from the engine: every prompt position scored, chunked prefill and a warm prefix
cache included, equal to transformers' float32 log-softmax within 1e-4."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.conftest import hf_from_gguf


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_across_chunks_and_cached_prefixes(smol_path):
    llm = LLM(dtype="float32", quantization="none", num_threads=2, kv_cache_memory=128 * 2**20, max_num_batched_tokens=16)
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs far away "
                                  "into the green forest where the old owl lives, "
                                  "next to a river full of silver fish and a small wooden bridge.")
    assert len(prompt) > 32  # three chunks of 16
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)  # warm the prefix cache first
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    ref = hf_from_gguf(smol_path)
    with torch.no_grad():
        theirs = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [L, V]
    for i in range(1, len(prompt)):
        entry, row = lps[i], theirs[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - row[prompt[i]].item()) < 1e-4
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(entry.top, top.values.tolist())) < 1e-4
