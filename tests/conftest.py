"""Shared fixtures: the embedded model's path and tiny random checkpoints made by the tests themselves."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest

# before torch: libgomp reads OMP_WAIT_POLICY (which `import lmserve` sets to PASSIVE, as every lmserve command runs)
# once, when torch loads it; else its idle threads spin between operations, beside the kernels' pool and the other
# xdist worker on 2 cores, and every engine built in a test warns so (config.TORCH_FIRST_SPINS)
import lmserve  # noqa: F401

# isort: split
import torch

# Two cores: keep torch from oversubscribing when tests start helper processes.
torch.set_num_threads(int(os.environ.get("LMSERVE_TEST_THREADS", "2")))

# Without a GPU the Triton kernels run under Triton's interpreter (CPU tensors through numpy). Triton reads the
# switch when a kernel is decorated, i.e. when lmserve.layers.kernels.triton's modules are first imported: setting it
# here, before pytest imports any test module, holds whatever order the tests import in (a fixture could run
# after another module had imported them; a subprocess per test would pay the start-up again). On a CUDA machine
# it stays unset, so the same tests compile the kernels for the GPU and the real-shape cases run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The weight cache (loader/repack_cache.py) of this run, in a temporary directory removed at the end: tests never
# write into the user's ~/.cache, and a model loaded again (the servers' embedded model) takes the cached path.
if "LMSERVE_WEIGHT_CACHE" not in os.environ:
    os.environ["LMSERVE_WEIGHT_CACHE"] = tempfile.mkdtemp(prefix="lmserve-weights-")
    atexit.register(shutil.rmtree, os.environ["LMSERVE_WEIGHT_CACHE"], True)


# A directory the run's processes share (the xdist workers inherit it from the process that imported this first),
# removed at the end: transformers' references parsed from a GGUF file once per run (hf_from_gguf).
if "LMSERVE_TEST_SHARED" not in os.environ:
    os.environ["LMSERVE_TEST_SHARED"] = tempfile.mkdtemp(prefix="lmserve-tests-")
    atexit.register(shutil.rmtree, os.environ["LMSERVE_TEST_SHARED"], True)


def hf_from_gguf(path) -> torch.nn.Module:
    """transformers' float32 model of a GGUF file, dequantized by transformers itself (the parity tests' reference).

    Its GGUF parse costs ~30 CPU s for the embedded model, and five test files (split over the xdist workers) need
    it: the first process to ask parses the file and pickles the module into LMSERVE_TEST_SHARED, the others load
    that copy (~2 s; the same tensors and config, tied weights still tied). Within one load the file is parsed once,
    not once for the config and again for the weights."""
    import functools
    import hashlib
    from pathlib import Path

    import gguf
    import transformers
    from filelock import FileLock

    path = Path(path)
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|"
                         f"{torch.__version__}".encode()).hexdigest()[:16]
    saved = Path(os.environ["LMSERVE_TEST_SHARED"]) / f"hf-{key}.pt"
    with FileLock(str(saved) + ".lock"):
        if saved.is_file():
            return torch.load(saved, weights_only=False).eval()
        with pytest.MonkeyPatch.context() as mp:
            read = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
            mp.setattr(gguf, "GGUFReader", lambda p, *args: read(os.fspath(p), *args))
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                      dtype=torch.float32).eval()
        torch.save(model, saved.with_suffix(".tmp"))
        saved.with_suffix(".tmp").rename(saved)
    return model


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


VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 128, 256, 3, 8, 2


def write_hub_snapshot(cache, hub_id: str, snapshot: str):
    """A Hugging Face cache entry for `hub_id` as `hf download` leaves one (refs/main naming the snapshot), holding a
    tiny Llama; returns the repo's folder in the cache."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(snapshot)
    (repo / "snapshots").mkdir()
    write_tiny_llama(repo / "snapshots" / snapshot)
    return repo


def write_tiny_llama(path) -> None:
    """config.json, model.safetensors (random, seeded) and a word-level tokenizer.json."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER)}
    tensors = {name: (1 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1
               else torch.randn(shape, generator=g) / shape[-1] ** 0.5 for name, shape in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


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
