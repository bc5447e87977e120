"""Shared fixtures: the embedded model's path and tiny random checkpoints made by the tests themselves."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: keep torch from oversubscribing when tests start helper processes.
torch.set_num_threads(int(os.environ.get("LMSERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def smol_path():
    from lmserve.loader import default_model_path

    return default_model_path()


def save_tiny_hf(tmp_path, kind: str, max_shard_size: str = "100KB"):
    """Create a tiny random Llama (llama3 rope scaling, untied) or Qwen2 (qkv bias, tied) HF checkpoint."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model = model.float().eval()
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return path, model


@pytest.fixture(scope="session")
def server():
    """One shared server on the embedded model for the black-box API tests."""
    from tests.server_util import running_server

    with running_server() as s:
        yield s


@pytest.fixture(scope="session")
def offline_llm():
    """The offline API on the same model, for comparing HTTP results with LLM.generate."""
    from lmserve import LLM

    return LLM(num_threads=2, kv_cache_memory=128 * 2**20)
