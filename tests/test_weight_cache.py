"""The on-disk cache of repacked GGUF layers (loader/repack_cache.py): a hit builds the same layers over the same
bytes without repacking, and gives the same greedy tokens; a corrupt, truncated or foreign entry is ignored and
rewritten, never served; another model never reads this one's entry; LMSERVE_WEIGHT_CACHE=0 writes nothing. The
same for the BPE merges a SentencePiece-style vocabulary derives (loader/start_cache.py), kept beside them."""

from __future__ import annotations

import pytest
import torch

from lmserve.loader import gguf_packed
from lmserve.loader.repack_cache import MAGIC
from lmserve.worker.transforms import load_formatted
from tests.test_gguf_linear import write_low_bit_gguf

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "weights"
    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", str(root))
    return root


def load(path):
    return load_formatted(path, torch.float32, CPU, quantization="gguf").model


def state(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model by name, with the layers' classes (a hit must build the same structure)."""
    out = {k: v.to_dense() if v.is_mkldnn else v for k, v in model.state_dict().items()}  # float layers: packed
    out["__classes__"] = [type(m).__name__ for m in model.modules()]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a["__classes__"] == b["__classes__"]
    for k in a:
        if k != "__classes__":
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def no_repack(monkeypatch) -> None:
    """A load from the cache must not repack a single tensor."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("repacked although the cache holds this file")

    monkeypatch.setattr(gguf_packed, "repack", refuse)


def greedy(path, tokenizer_dir) -> list[list[int]]:
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.sampling_params import SamplingParams
    from lmserve.tokenizer import Tokenizer

    eng = LLMEngine(EngineConfig(model=str(path), quantization="gguf", cache=CacheConfig(num_blocks=32)),
                    tokenizer=Tokenizer.from_pretrained(tokenizer_dir))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, ids in enumerate([[5, 17, 200, 3, 9], list(range(40, 71))]):
        eng.add_request(str(i), ids, params)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out["0"], out["1"]]


def test_a_hit_is_the_same_model_bit_for_bit_without_repacking(tmp_path, cache, monkeypatch):
    """Q2_K..IQ4_XS layers in several layouts (fused parts, own head): the second load maps the first one's entry."""
    from tests.tiny_models import write_word_tokenizer

    path = tmp_path / "low.gguf"
    write_low_bit_gguf(path)
    write_word_tokenizer(tmp_path)
    built = state(load(path))
    tokens = greedy(path, tmp_path)
    assert sorted(p.suffix for p in cache.iterdir()) == [".header", ".lmw"]  # the weights, and the parsed header
    with monkeypatch.context() as m:
        no_repack(m)
        assert_same(state(load(path)), built)
        assert greedy(path, tmp_path) == tokens


def test_a_bad_entry_is_ignored_and_rewritten(tmp_path, cache, monkeypatch):
    path = tmp_path / "low.gguf"
    write_low_bit_gguf(path, layers=1)
    built = state(load(path))
    (entry,) = cache.glob("*.lmw")
    good = entry.read_bytes()
    for bad in (good[:-100],  # truncated
                # 64 flipped bytes in the middle of the data
                good[:len(good) // 2] + bytes(b ^ 0x55 for b in good[len(good) // 2:][:64]) + good[len(good) // 2 + 64:],
                b"NOTMAGIC" + good[len(MAGIC):],
                good.replace(b'"key": "', b'"key": "x', 1)):  # written by another build
        entry.write_bytes(bad)
        assert_same(state(load(path)), built)
        assert entry.read_bytes() == good  # rewritten by the load that ignored it
    with monkeypatch.context() as m:  # and now served
        no_repack(m)
        assert_same(state(load(path)), built)


def write_biased_gguf(path, seed: int) -> None:
    """A tiny Qwen2 GGUF (q/k/v biases, the LM head tied to the table) of random Q8_0 blocks; `seed` picks them."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType

    from tests.test_gguf_linear import random_blocks

    hidden, inter, vocab, rng = 64, 128, 256, np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 10000.0)):
        add(value)
    for name, rows, cols in (("token_embd", vocab, hidden), ("blk.0.attn_q", hidden, hidden),
                             ("blk.0.attn_k", 32, hidden), ("blk.0.attn_v", 32, hidden),
                             ("blk.0.attn_output", hidden, hidden), ("blk.0.ffn_gate", inter, hidden),
                             ("blk.0.ffn_up", inter, hidden), ("blk.0.ffn_down", hidden, inter)):
        raw = random_blocks("Q8_0", rows, cols, seed=int(rng.integers(1 << 30)))
        w.add_tensor(name + ".weight", raw, raw_dtype=GGMLQuantizationType.Q8_0)
    for name, n in (("blk.0.attn_q.bias", hidden), ("blk.0.attn_k.bias", 32), ("blk.0.attn_v.bias", 32),
                    ("blk.0.attn_norm.weight", hidden), ("blk.0.ffn_norm.weight", hidden), ("output_norm.weight", hidden)):
        w.add_tensor(name, rng.standard_normal(n).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_another_model_never_reads_this_ones_entry(tmp_path, cache):
    """Two files of one architecture and shapes, with q/k/v biases (the loader fills them after the layers are
    built) and a tied head (one set of blocks for table and head), different weights: each load is its own file's
    model, and each file has its own entry."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_biased_gguf(a, seed=1)
    write_biased_gguf(b, seed=2)
    fresh_a, fresh_b = state(load(a)), state(load(b))  # misses: both written
    assert len(list(cache.glob("*.lmw"))) == 2
    hit_a, hit_b = state(load(a)), state(load(b))
    assert_same(hit_a, fresh_a)
    assert_same(hit_b, fresh_b)
    bias = next(k for k in hit_a if k.endswith("qkv_proj.bias"))
    assert not torch.equal(hit_a[bias], hit_b[bias])
    model = load(a)
    assert model.lm_head.codes.data_ptr() == model.model.embed_tokens.codes.data_ptr()


def test_off_writes_nothing(tmp_path, monkeypatch):
    import os
    import uuid
    from pathlib import Path

    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", "0")
    path = tmp_path / f"off-{uuid.uuid4().hex}.gguf"  # a name no entry can have yet
    write_low_bit_gguf(path, layers=1)
    load(path)
    root = Path(os.environ.get("LMSERVE_CACHE_DIR", Path.home() / ".cache" / "lmserve")) / "weights"
    assert not list(root.glob(path.stem + "*"))


def test_derived_merges_are_cached_checked_and_rebuilt(cache, tmp_path, monkeypatch):
    """Gemma-style vocabularies store no merges: the first tokenizer build derives and writes them, the next reads
    them back (deriving nothing) and tokenizes identically; a corrupt, truncated, foreign-magic or other-code entry
    is derived again and rewritten; LMSERVE_WEIGHT_CACHE=0 writes nothing."""
    from lmserve.loader import start_cache
    from lmserve.tokenizer import Tokenizer, gguf_vocab
    from tests.test_family_tokenizers import write_gemma_vocab

    src = tmp_path / "gemma3.gguf"
    write_gemma_vocab(src)
    derived = []
    real = gguf_vocab.merges_by_position
    monkeypatch.setattr(gguf_vocab, "merges_by_position", lambda *a: derived.append(1) or real(*a))
    text = "The quick brown fox   jumps over the lazy dog"
    first = Tokenizer.from_gguf(src).encode(text)
    (entry,) = cache.glob("gemma3-*.merges")
    assert len(derived) == 1 and len(first) > 3
    assert Tokenizer.from_gguf(src).encode(text) == first and len(derived) == 1  # read back, not derived
    good = entry.read_bytes()
    for bad in (good[:-7], b"NOTMERGE" + good[8:], good[:-1] + bytes([good[-1] ^ 0xFF]),
                good[:8] + b"0" * 16 + good[24:]):  # truncated, foreign magic, a flipped byte, another key
        entry.write_bytes(bad)
        assert Tokenizer.from_gguf(src).encode(text) == first
        assert entry.read_bytes() == good  # derived again and rewritten
    assert len(derived) == 5
    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", "0")
    entry.unlink()
    assert Tokenizer.from_gguf(src).encode(text) == first and len(derived) == 6
    assert not list(cache.glob("*.merges"))
    assert start_cache.MAGIC == good[:8]
