"""The other encoders llama.cpp's convert_hf_to_gguf.py writes a GGUF for: XLM-RoBERTa (general.architecture bert,
a SentencePiece Unigram vocabulary, tokenizer.ggml.model 't5': tokenizer/gguf_vocab.py `_unigram`) and ModernBERT
(modern-bert, a byte-level BPE vocabulary: models/rotary_encoder.py `_modern_gguf`). Each is a tiny random model made
by transformers, converted by the converter itself, and loaded against sentence-transformers and our load of the
same safetensors directory."""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.engine.llm import LLM
from tests.encoder_models import SENTENCES, convert_to_gguf, modernbert_for_converter, xlm_roberta_for_converter
from tests.test_encoders import _vectors, mixed_sentences

# texts the tiny Unigram (trained on tests/encoder_models.py's UNIGRAM_CORPUS) spells in at most 128 tokens: words it
# has pieces for, words it spells letter by letter, characters it has never seen, and spaces of every kind
TEXTS = SENTENCES + [t for t in mixed_sentences(40, seed=2) if len(t) < 120] + [
    "Héllo, WORLD! naïve café 東京 don't", "unaffable tokenization 123.45", "  spaces\tand\nlines ",
    "Ｆｕｌｌｗｉｄｔｈ ﬁne œuvre", "a  b   c", "東京東京 x", "tokenizers retokenized"]


@pytest.fixture(scope="module")
def xlm_roberta(tmp_path_factory):
    root = tmp_path_factory.mktemp("xlmr")
    path = xlm_roberta_for_converter(root)
    return path, convert_to_gguf(path, "f32", root / "xlmr-f32.gguf")


def test_xlm_roberta_gguf_unigram_tokenizes_as_its_tokenizers(xlm_roberta):
    """The 't5' vocabulary as a Unigram: ids as transformers' tokenizer.json and as SentencePiece itself (fairseq's
    ids: one up, <unk> at 3), pairs framed as XLM-R's; the precompiled charsmap folds fullwidth forms and ligatures."""
    import sentencepiece
    from tokenizers import Tokenizer as HFTokenizer

    from lmserve.loader.gguf_file import read_gguf
    from lmserve.tokenizer.tokenizer import Tokenizer

    path, gguf = xlm_roberta
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


def test_xlm_roberta_gguf_matches_sentence_transformers(xlm_roberta):
    """The converter drops the position table's first padding_idx + 1 rows: the file's positions start at 0."""
    from sentence_transformers import SentenceTransformer

    path, gguf = xlm_roberta
    ref = SentenceTransformer(str(path), device="cpu").encode(TEXTS, normalize_embeddings=True)
    llm = LLM(str(gguf), max_num_seqs=64)
    assert (llm.engine.front.pooler.method, llm.engine.front.pooler.source) == ("mean", "bert.pooling_type")
    assert llm.engine.model_config.position_offset == 0 and llm.engine.model_config.type_vocab_size == 1
    got = _vectors(llm, TEXTS)
    assert np.abs(got - ref).max() < 1e-4  # measured 1.0e-7
    assert np.abs(got - _vectors(LLM(str(path), max_num_seqs=64), TEXTS)).max() < 1e-5  # measured 0


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    root = tmp_path_factory.mktemp("modernbert")
    path = modernbert_for_converter(root)
    return path, convert_to_gguf(path, "f32", root / "modernbert-f32.gguf", pre="modern-bert")


def test_modernbert_gguf_matches_sentence_transformers(modernbert):
    """The window pattern (global, local, global), the ±4 local window and both rotary bases from the file's
    metadata; sequences of up to 82 tokens, so that the window cuts. The byte-level BPE tokenizes (and frames
    pairs) as the tokenizer.json it came from."""
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer as HFTokenizer

    from lmserve.tokenizer.tokenizer import Tokenizer

    path, gguf = modernbert
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
    assert np.abs(got - SentenceTransformer(str(path), device="cpu").encode(TEXTS, normalize_embeddings=True)
                  ).max() < 1e-4  # measured 1.9e-7
    assert np.abs(got - _vectors(LLM(str(path), max_num_seqs=64), TEXTS)).max() < 1e-5  # measured 0


@pytest.mark.parametrize("kind", ["xlm-roberta", "modernbert"])
def test_cross_encoder_gguf_matches_sentence_transformers(tmp_path, kind):
    """A reranker from the file (XLM-R: bge-reranker-v2-m3's kind, the head's dense + out_proj as cls and
    cls.output; ModernBERT: dense, norm, classifier as cls, cls.norm, cls.output, CLS-pooled): pairs framed as the
    model's tokenizer frames them, scores as sentence-transformers' CrossEncoder gives them."""
    from sentence_transformers import CrossEncoder

    if kind == "xlm-roberta":
        path = xlm_roberta_for_converter(tmp_path, num_labels=1)
        gguf = convert_to_gguf(path, "f32", tmp_path / "ce.gguf")
    else:
        path = modernbert_for_converter(tmp_path, num_labels=1)
        gguf = convert_to_gguf(path, "f32", tmp_path / "ce.gguf", pre="modern-bert")
    pairs = [(q, d) for q in SENTENCES[:2] for d in TEXTS[:8]]
    ref = CrossEncoder(str(path), device="cpu").predict(pairs)  # sigmoid of the one logit (its default activation)
    llm = LLM(str(gguf))
    assert llm.engine.front.tasks == ("score", "rerank", "classify")
    got = _vectors(llm, [llm.tokenizer.encode_pair(q, d) for q, d in pairs])[:, 0]
    assert np.abs(got - ref).max() < 1e-4


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
