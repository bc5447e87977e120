"""Logits equal to Hugging Face transformers (float32) for the embedded GGUF and tiny sharded checkpoints."""

from __future__ import annotations

import pytest
import torch

from lmserve.layers.attention.context import ContiguousAttention
from lmserve.worker.transforms import load_formatted
from tests.conftest import hf_from_gguf, save_tiny_hf

TOL = 1e-4


def flat_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one flat forward (no padding), split back per prompt."""
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos, ContiguousAttention([len(p) for p in prompts])))
    return list(logits.split([len(p) for p in prompts]))


def assert_parity(ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= tol, f"max |dlogit| / max |logit| = {rel:.2e} > {tol}"


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 17, 64, 333)]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_sharded_checkpoint_matches_transformers(tmp_path, kind):
    path, ref = save_tiny_hf(tmp_path, kind)
    assert len(list(path.glob("*.safetensors"))) >= 2, "checkpoint should be sharded"
    loaded = load_formatted(path, torch.float32, torch.device("cpu"))
    assert loaded.format == "safetensors"
    if kind == "llama":
        assert loaded.config.rope_type == "llama3" and not loaded.config.tie_word_embeddings
    else:
        assert loaded.config.qkv_bias and loaded.config.tie_word_embeddings
    prompts = prompts_for(loaded.config.vocab_size)
    for prompt, ours in zip(prompts, flat_logits(loaded.model, prompts)):
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        assert_parity(ours, theirs)


@pytest.mark.slow
def test_embedded_gguf_matches_transformers(smol_path):
    ref = hf_from_gguf(smol_path)
    loaded = load_formatted(smol_path, torch.float32, torch.device("cpu"))
    cfg = loaded.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    prompts = prompts_for(cfg.vocab_size)
    for prompt, ours in zip(prompts, flat_logits(loaded.model, prompts)):
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        assert_parity(ours, theirs)
