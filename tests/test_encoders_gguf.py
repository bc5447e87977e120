"""Encoders from GGUF files as llama.cpp's own convert_hf_to_gguf.py writes them (models/bert.py `_bert_gguf`,
tokenizer/gguf_vocab.py's WordPiece, loader/pooling.py `gguf_pooler`): the real all-MiniLM-L6-v2 converted to f32,
f16 and q8_0 against our load of its safetensors directory, its vocabulary against its tokenizer.json, a tiny NomicBERT
(llama.cpp's nomic-bert; f32, f16, q8_0) against sentence-transformers, and a BERT cross-encoder whose pooler the converter drops
refused."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from lmserve.engine.llm import LLM
from lmserve.errors import CheckpointError
from lmserve.layers.formats.gguf_linear import GGUFLinear
from lmserve.loader.pooling import gguf_pooler, pooler_config
from tests.encoder_models import (
    SENTENCES,
    convert_to_gguf,
    minilm_dir,
    minilm_gguf,
    nomic_bert_for_converter,
    rounded_to_f16,
)
from tests.test_encoders import _vectors, mixed_sentences

# the largest cosine gap to the safetensors load: f32 is the same arithmetic on the same weights (measured 2e-16);
# f16 rounds every weight to 11 bits (measured 1.9e-7 at worst over these 100 sentences); q8_0 rounds the projections
# and the embedding table to 8 bits per block of 32 (measured 3.3e-4, |difference| 4.4e-3); kept in its blocks (the
# default), the int8 kernels also round each activation row to 8 bits per block of 32, as llama.cpp does (measured
# 1.4e-3, |difference| 9.0e-3)
TOLERANCE = {"f32": 1e-5, "f16": 1e-5, "q8_0": 2e-3}
DEQUANTIZED_Q8_0 = 1e-3


@pytest.fixture(scope="module")
def safetensors_vectors():
    texts = mixed_sentences()
    return texts, _vectors(LLM(str(minilm_dir()), max_num_seqs=64), texts)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_minilm_gguf_matches_the_safetensors_load(safetensors_vectors, outtype, caplog):
    texts, ref = safetensors_vectors
    with caplog.at_level(logging.INFO, logger="lmserve"):
        llm = LLM(str(minilm_gguf(outtype)), max_num_seqs=64)
    # a BERT file's Q8_0 projections stay in their blocks (6 layers x qkv, output, up, down; the log line or, on a
    # weight-cache hit, the cache's), f32 and f16 are read as float
    kept = [m for m in llm.engine.loaded.model.modules() if isinstance(m, GGUFLinear)]
    assert llm.engine.loaded.runtime_quantization == ("gguf" if outtype == "q8_0" else None)
    assert len(kept) == (24 if outtype == "q8_0" else 0)
    pooler = llm.engine.front.pooler
    assert (pooler.method, pooler.source, pooler.normalize) == ("mean", "bert.pooling_type", True)
    assert llm.engine.front.tasks == ("embed", "score", "rerank")
    batched = _vectors(llm, texts)  # mixed lengths in one step
    assert 1 - _cosine(batched, ref).min() < TOLERANCE[outtype]
    assert np.abs(np.linalg.norm(batched, axis=1) - 1).max() < 1e-5  # normalised, as llama-server's default
    picks = sorted(range(len(texts)), key=lambda i: len(texts[i]))[::20]  # one at a time, short to long
    single = np.stack([_vectors(llm, [texts[i]])[0] for i in picks])
    assert 1 - _cosine(single, ref[picks]).min() < TOLERANCE[outtype]
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    if outtype == "q8_0":  # --quantization none: the same file dequantized on load, float linears
        float_llm = LLM(str(minilm_gguf(outtype)), max_num_seqs=64, quantization="none")
        assert not any(isinstance(m, GGUFLinear) for m in float_llm.engine.loaded.model.modules())
        assert 1 - _cosine(_vectors(float_llm, texts), ref).min() < DEQUANTIZED_Q8_0
        with pytest.raises(CheckpointError, match="float32"):  # the kernels read float32 scales: refused, not a crash
            LLM(str(minilm_gguf(outtype)), quantization="gguf", dtype="bfloat16")


def test_minilm_gguf_vocabulary_tokenizes_as_its_tokenizer_json():
    """WordPiece rebuilt from llama.cpp's phantom-space spelling: ids and pair framing as the original's."""
    from tokenizers import Tokenizer as HFTokenizer

    from lmserve.tokenizer.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf(minilm_gguf("f32"))
    ref = HFTokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    ref.no_padding()
    ref.no_truncation()
    texts = mixed_sentences(20, seed=1) + ["Héllo, WORLD! naïve café 東京 don't", "unaffable tokenization 123.45",
                                           "  spaces\tand\nlines ", "x" * 150]
    for text in texts:
        assert ours.encode(text) == ref.encode(text).ids, text
    pair = ref.encode("a query", "the document")
    assert ours.encode_pair("a query", "the document") == pair.ids
    assert ours.decode(ours.encode("Unaffable tokenization.")) == "unaffable tokenization."


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_nomic_bert_gguf_matches_sentence_transformers(tmp_path, outtype):
    """f16 is converted from `rounded_to_f16`'s copy and compared with it: the same weights, so the same tolerance
    as f32 (measured 1.6e-7 and 1.8e-7); q8_0 against the unrounded model (measured 1.2e-2 with its blocks kept: the
    tiny model's 0.2-spread random weights, as tests/test_encoders_gguf_more.py's q8_0 XLM-R and ModernBERT)."""
    from sentence_transformers import SentenceTransformer

    path = nomic_bert_for_converter(tmp_path)
    path = rounded_to_f16(path) if outtype == "f16" else path
    ref = SentenceTransformer(str(path), device="cpu").encode(SENTENCES, normalize_embeddings=True)
    gguf = convert_to_gguf(path, outtype, tmp_path / f"nomic-{outtype}.gguf")
    llm = LLM(str(gguf))
    assert llm.engine.front.pooler.method == "mean"
    assert np.abs(_vectors(llm, SENTENCES) - ref).max() < (2e-2 if outtype == "q8_0" else 1e-4)
    # q8_0's projections stay in their blocks (2 layers x Wqkv, out_proj, fc12 + fc11 as one gate_up, fc2): measured
    # 1.2e-2 (8.8e-3 dequantized by a --quantization none load of the same file, float linears)
    kept = [m for m in llm.engine.loaded.model.modules() if isinstance(m, GGUFLinear)]
    assert len(kept) == (8 if outtype == "q8_0" else 0)
    if outtype == "q8_0":
        float_llm = LLM(str(gguf), quantization="none")
        assert not any(isinstance(m, GGUFLinear) for m in float_llm.engine.loaded.model.modules())
        assert np.abs(_vectors(float_llm, SENTENCES) - ref).max() < 2e-2


def test_gguf_pooling_type_read_from_metadata(tmp_path):
    meta = {"general.architecture": "bert"}
    assert gguf_pooler(meta | {"bert.pooling_type": 2}, None, True).method == "cls"
    assert gguf_pooler(meta | {"bert.pooling_type": 3}, None, True).method == "last"
    assert gguf_pooler(meta, None, True).method == "cls"  # absent: an encoder's default (vLLM's)
    assert gguf_pooler(meta | {"bert.pooling_type": 1}, "cls", True).source == "--pooling"
    with pytest.raises(CheckpointError, match="pooling_type 4"):
        gguf_pooler(meta | {"bert.pooling_type": 4}, None, True)
    # a classifier's labels come from the file, not from a config.json that lies beside it
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "wrong", "1": "file"}}))
    labelled = pooler_config(tmp_path / "m.gguf", None, True, 2, meta | {"bert.classifier.output_labels": ["no", "yes"]})
    assert labelled.labels == ("no", "yes") and labelled.method == "cls"
    assert pooler_config(tmp_path / "m.gguf", None, True, 2, meta).labels == ("LABEL_0", "LABEL_1")


def test_bert_cross_encoder_gguf_without_its_pooler_is_refused(tmp_path):
    """llama.cpp's converter keeps a BertForSequenceClassification's classifier but drops the pooler dense layer the
    head reads (transformers: classifier(tanh(pooler(CLS)))), so the file cannot give the model's scores."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=64, num_labels=1)
    path = tmp_path / "ce"
    transformers.BertForSequenceClassification(cfg).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # a vocabulary it knows
        shutil.copy(minilm_dir() / name, path / name)
    out = convert_to_gguf(path, "f32", tmp_path / "ce.gguf")
    from lmserve.loader.gguf_file import read_gguf

    names = {t.name for t in read_gguf(out).tensors}
    assert "cls.output.weight" in names and "cls.weight" not in names  # what the converter wrote
    with pytest.raises(CheckpointError, match="pooler"):
        LLM(str(out))
    assert json.loads((path / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
