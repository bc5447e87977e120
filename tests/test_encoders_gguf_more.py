"""The other encoders llama.cpp's convert_hf_to_gguf.py writes a GGUF for: XLM-RoBERTa (general.architecture bert,
a SentencePiece Unigram vocabulary, tokenizer.ggml.model 't5': tokenizer/gguf_vocab.py `_unigram`) and ModernBERT
(modern-bert, a byte-level BPE vocabulary: models/rotary_encoder.py `_modern_gguf`). Each is a tiny random model made
by transformers, converted by the converter itself (--outtype f32, f16 and q8_0), and loaded against
sentence-transformers and our load of the same safetensors directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lmserve.engine.llm import LLM
from tests.encoder_models import (
    SENTENCES,
    convert_to_gguf,
    modernbert_for_converter,
    rounded_to_f16,
    xlm_roberta_for_converter,
)
from tests.test_encoders import _vectors, mixed_sentences

# texts the tiny Unigram (trained on tests/encoder_models.py's UNIGRAM_CORPUS) spells in at most 128 tokens: words it
# has pieces for, words it spells letter by letter, characters it has never seen, and spaces of every kind
TEXTS = SENTENCES + [t for t in mixed_sentences(40, seed=2) if len(t) < 120] + [
    "Héllo, WORLD! naïve café 東京 don't", "unaffable tokenization 123.45", "  spaces\tand\nlines ",
    "Ｆｕｌｌｗｉｄｔｈ ﬁne œuvre", "a  b   c", "東京東京 x", "tokenizers retokenized"]

OUTTYPES = ["f32", "f16", "q8_0"]
# the largest |difference| allowed to sentence-transformers (unit vectors, or sigmoid scores). f32 and f16 are the
# same arithmetic on the same weights: an f16 file is converted from `rounded_to_f16`'s copy and compared with that
# copy (measured 1e-7 to 4e-7; 0 to our load of the copy). q8_0 rounds each projection and the embedding table to 8
# bits per block of 32 and is compared with the unrounded model: measured 6.1e-3 (XLM-R) and 8.5e-3 (ModernBERT) on
# embeddings, 5.8e-3 and 9.0e-3 on scores (these tiny models' 0.2-spread random weights; all-MiniLM-L6-v2's q8_0 is
# 4.4e-3 off its safetensors load)
TOLERANCE = {"f32": 1e-4, "f16": 1e-4, "q8_0": 2e-2}
OURS = {"f32": 1e-5, "f16": 1e-5, "q8_0": 2e-2}  # to our load of the same (rounded) safetensors: measured 0, 0, 8.5e-3


def converted(path: Path, outtype: str, pre: str | None = None) -> tuple[Path, Path]:
    """(the reference directory for `outtype`: `path`, or its f16-rounded copy for f16; the converter's GGUF of it)."""
    from lmserve.loader.gguf_file import read_gguf, type_name

    ref = rounded_to_f16(path) if outtype == "f16" else path
    gguf = convert_to_gguf(ref, outtype, ref.with_name(f"{ref.name}-{outtype}.gguf"), pre=pre)
    types = {t.name: type_name(t) for t in read_gguf(gguf).tensors}
    # the file holds what it is named for: the projections in `outtype`, the norms f32 (llama.cpp keeps them so)
    norms = {kind for name, kind in types.items() if "norm" in name}
    assert (types["blk.0.attn_output.weight"], norms) == (outtype.upper(), {"F32"})
    return ref, gguf


@pytest.fixture(scope="module")
def xlm_roberta(tmp_path_factory):
    return xlm_roberta_for_converter(tmp_path_factory.mktemp("xlmr"))


def test_xlm_roberta_gguf_unigram_tokenizes_as_its_tokenizers(xlm_roberta):
    """The 't5' vocabulary as a Unigram: ids as transformers' tokenizer.json and as SentencePiece itself (fairseq's
    ids: one up, <unk> at 3), pairs framed as XLM-R's; the precompiled charsmap folds fullwidth forms and ligatures."""
    import sentencepiece
    from tokenizers import Tokenizer as HFTokenizer

    from lmserve.loader.gguf_file import read_gguf
    from lmserve.tokenizer.tokenizer import Tokenizer

    path, gguf = converted(xlm_roberta, "f32")
    meta = read_gguf(gguf).metadata
    assert meta["tokenizer.ggml.model"] == "t5" and len(meta["tokenizer.ggml.precompiled_charsmap"]) > 0
    assert meta["tokenizer.ggml.remove_extra_whitespaces"] and meta["tokenizer.ggml.add_sep_token"]
    ours = Tokenizer.from_gguf(gguf)
    ref = HFTokenizer.from_file(str(path / "tokenizer.json"))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path / "sentencepiece.bpe.model"))
    for text in TEXTS + ["", " ", "x" * 150]:
        ids = ours.encode(text)
        assert ids == ref.encode(text).ids, text
        assert ids == [0] + [3 if i == sp.unk_id() else i + 1 for i in sp.encode(text)] + [2], text
    assert 3 in ours.encode("東京") and ours.encode("ﬁne") == ours.encode("fine")
    assert ours.encode_pair("a query", "the document") == ref.encode("a query", "the document").ids
    assert ours.decode(ours.encode("Héllo, WORLD! naïve café")) == "Héllo, WORLD! naïve café"


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_xlm_roberta_gguf_matches_sentence_transformers(xlm_roberta, outtype):
    """The converter drops the position table's first padding_idx + 1 rows: the file's positions start at 0."""
    from sentence_transformers import SentenceTransformer

    path, gguf = converted(xlm_roberta, outtype)
    ref = SentenceTransformer(str(path), device="cpu").encode(TEXTS, normalize_embeddings=True)
    llm = LLM(str(gguf), max_num_seqs=64)
    assert (llm.engine.front.pooler.method, llm.engine.front.pooler.source) == ("mean", "bert.pooling_type")
    assert llm.engine.model_config.position_offset == 0 and llm.engine.model_config.type_vocab_size == 1
    got = _vectors(llm, TEXTS)
    assert np.abs(got - ref).max() < TOLERANCE[outtype]  # measured 1.0e-7 (f32)
    assert np.abs(got - _vectors(LLM(str(path), max_num_seqs=64), TEXTS)).max() < OURS[outtype]
    if outtype == "q8_0":  # llama.cpp writes XLM-R as a BERT: its projections stay in their blocks
        from lmserve.layers.formats.gguf_linear import GGUFLinear

        assert llm.engine.loaded.runtime_quantization == "gguf"
        assert isinstance(llm.engine.loaded.model.blocks[0].qkv, GGUFLinear)


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    return modernbert_for_converter(tmp_path_factory.mktemp("modernbert"))


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_modernbert_gguf_matches_sentence_transformers(modernbert, outtype):
    """The window pattern (global, local, global), the ±4 local window and both rotary bases from the file's
    metadata; sequences of up to 82 tokens, so that the window cuts. The byte-level BPE tokenizes (and frames
    pairs) as the tokenizer.json it came from."""
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer as HFTokenizer

    from lmserve.tokenizer.tokenizer import Tokenizer

    path, gguf = converted(modernbert, outtype, pre="modern-bert")
    ours, ref = Tokenizer.from_gguf(gguf), HFTokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS + ["", "x" * 150]:
        assert ours.encode(text) == ref.encode(text).ids, text
    assert ours.encode_pair("a query", "the document") == ref.encode("a query", "the document").ids
    llm = LLM(str(gguf), max_num_seqs=64)
    cfg = llm.engine.model_config
    assert (cfg.layer_types, cfg.sliding_window, cfg.rope_theta, cfg.local_rope_theta) == (
        ("full", "sliding", "full"), 4, 160000.0, 10000.0)
    assert llm.engine.front.pooler.method == "mean"
    got = _vectors(llm, TEXTS)
    st = SentenceTransformer(str(path), device="cpu").encode(TEXTS, normalize_embeddings=True)
    assert np.abs(got - st).max() < TOLERANCE[outtype]  # measured 1.9e-7 (f32)
    ours = _vectors(LLM(str(path), max_num_seqs=64), TEXTS)
    assert np.abs(got - ours).max() < OURS[outtype]
    if outtype == "q8_0":
        from lmserve.errors import CheckpointError
        from lmserve.layers.formats.gguf_linear import GGUFLinear

        # the projections stay in their blocks (3 layers x Wqkv, Wo, Wi, mlp.Wo), the int8 kernels rounding each
        # activation row per 32 as llama.cpp's do: measured 1.2e-2 to sentence-transformers (8.5e-3 dequantized on load
        # by --quantization none, float linears)
        kept = [m for m in llm.engine.loaded.model.modules() if isinstance(m, GGUFLinear)]
        assert (llm.engine.loaded.runtime_quantization, len(kept)) == ("gguf", 12)
        float_llm = LLM(str(gguf), max_num_seqs=64, quantization="none")
        assert not any(isinstance(m, GGUFLinear) for m in float_llm.engine.loaded.model.modules())
        assert np.abs(_vectors(float_llm, TEXTS) - st).max() < TOLERANCE[outtype]
        with pytest.raises(CheckpointError, match="float32"):  # the kernels read float32 scales: refused
            LLM(str(gguf), quantization="gguf", dtype="bfloat16")


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("kind", ["xlm-roberta", "modernbert"])
def test_cross_encoder_gguf_matches_sentence_transformers(tmp_path, kind, outtype):
    """A reranker from the file (XLM-R: bge-reranker-v2-m3's kind, the head's dense + out_proj as cls and
    cls.output; ModernBERT: dense, norm, classifier as cls, cls.norm, cls.output, CLS-pooled): pairs framed as the
    model's tokenizer frames them, scores as sentence-transformers' CrossEncoder gives them."""
    from sentence_transformers import CrossEncoder

    if kind == "xlm-roberta":
        path, gguf = converted(xlm_roberta_for_converter(tmp_path, num_labels=1), outtype)
    else:
        path, gguf = converted(modernbert_for_converter(tmp_path, num_labels=1), outtype, pre="modern-bert")
    pairs = [(q, d) for q in SENTENCES[:2] for d in TEXTS[:8]]
    ref = CrossEncoder(str(path), device="cpu").predict(pairs)  # sigmoid of the one logit (its default activation)
    llm = LLM(str(gguf))
    assert llm.engine.front.tasks == ("score", "rerank", "classify")
    got = _vectors(llm, [llm.tokenizer.encode_pair(q, d) for q, d in pairs])[:, 0]
    assert np.abs(got - ref).max() < TOLERANCE[outtype]


def test_unigram_vocabulary_from_metadata_alone():
    """A 't5' vocabulary the file cannot make is a CheckpointError naming what, never a traceback; absent keys
    take llama.cpp's defaults."""
    from lmserve.errors import CheckpointError
    from lmserve.tokenizer.gguf_vocab import build_from_gguf

    meta = {"general.architecture": "bert", "tokenizer.ggml.model": "t5", "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.tokens": ["<unk>", "\u2581a"], "tokenizer.ggml.scores": [0.0, -1.0],
            "tokenizer.ggml.token_type": [2, 1], "tokenizer.ggml.remove_extra_whitespaces": True}
    assert build_from_gguf(meta, "ok.gguf").hf.encode("a").ids == [1]
    with pytest.raises(CheckpointError, match="precompiled charsmap"):
        build_from_gguf(meta | {"tokenizer.ggml.precompiled_charsmap": [0, 1, 2]}, "m.gguf")
    with pytest.raises(CheckpointError, match="no scores"):
        build_from_gguf(meta | {"tokenizer.ggml.scores": [0.0]}, "m.gguf")
    with pytest.raises(CheckpointError, match="names no unknown token"):
        build_from_gguf({k: v for k, v in meta.items() if k != "tokenizer.ggml.unknown_token_id"}, "m.gguf")
    # keys absent: llama.cpp's UGM defaults, no BOS, an EOS, no prefix space, spaces kept one "▁" each
    bare = build_from_gguf(meta | {"tokenizer.ggml.tokens": ["<unk>", "\u2581a", "</s>", "a"],
                                   "tokenizer.ggml.scores": [0.0, -1.0, 0.0, -1.0],
                                   "tokenizer.ggml.token_type": [2, 1, 3, 1], "tokenizer.ggml.eos_token_id": 2,
                                   "tokenizer.ggml.remove_extra_whitespaces": False}, "bare.gguf")
    assert bare.hf.encode("a").ids == [3, 2] and bare.hf.encode(" a").ids == [1, 2]
