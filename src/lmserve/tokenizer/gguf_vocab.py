"""GGUF tokenizer metadata -> a Hugging Face `tokenizers.Tokenizer`, tokenizing as llama.cpp does.

Four GGUF vocabularies are supported:
- "gpt2": byte-level BPE (Llama 3, Qwen 2, SmolLM, ...): tokens, merges, and the pre-tokenizer
  regexes named by `tokenizer.ggml.pre` (llama.cpp's table; an unknown name is an error, since a
  wrong split silently changes every prompt).
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral): merges are implied by the
  piece scores, and the prefix space goes before every run of text, after special tokens too,
  as llama.cpp and sentencepiece itself do. Gemma's files use the same model name, but their
  scores do not follow the merge order (the pieces' order in the file does), multi-space pieces
  are stored as real spaces, and there is no prefix space: built as transformers rebuilds them.
- "bert": WordPiece (BERT, MiniLM, bge): llama.cpp's converter spells a word-start piece "▁piece" and a
  continuation "piece" (the "##" dropped); the HF WordPiece vocabulary is rebuilt from that, framed as BERT
  frames texts and pairs ([CLS] a [SEP] b [SEP], types 0 / 1).
- "t5": SentencePiece Unigram ("UGM" in llama.cpp: XLM-RoBERTa, bge-m3): the pieces and their scores as a Unigram
  model, normalised as llama.cpp's llm_tokenizer_ugm does (the precompiled charsmap, then spaces: each run of
  non-space text after one "▁", extra spaces dropped), framed by the file's add_bos / add_eos / add_sep.
Token types mark control tokens (special) and user-defined ones (always matched whole).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from lmserve.errors import CheckpointError
from lmserve.loader.start_cache import cached

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5  # GGUF token_type values (6 byte)
SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# encoders whose vocabulary is not "bert" WordPiece (XLM-R's Unigram and RoBERTa's BPE in a bert file, ModernBERT's BPE)
# frame texts and pairs as llama.cpp's rerank prompt does
ENCODER_ARCHS = frozenset({"bert", "modern-bert", "nomic-bert"})
# Special-token ids by template variable name (the four transformers reads from a GGUF).
NAMED_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
             "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}
# Generation ends at these ids, and at tokens spelled like an end-of-turn marker (llama.cpp's EOG set).
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
EOG_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                       "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
                       "<end_of_utterance>"})


class PreTokenizer(NamedTuple):
    """How a byte-level vocabulary splits text before BPE (the splits apply in order)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a split that is itself a token is taken whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token key


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _cased_words(suffix: str) -> str:
    """Words split at case changes (Mistral's tekken, GPT-4o), each optionally followed by `suffix`."""
    upper, lower, lead = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}"


_TEKKEN = _cased_words("") + r"|\p{N}" + _TAIL
_GPT4O = _cased_words(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?") + r"|\p{N}{1,3}" + _TAIL


def _table(*groups: tuple[tuple[str, ...], PreTokenizer]) -> dict[str, PreTokenizer]:
    return {name: pre for names, pre in groups for name in names}


PRE_TOKENIZERS: dict[str, PreTokenizer] = _table(
    (("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "modern-bert"), PreTokenizer((_GPT2,))),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     PreTokenizer((r"\p{N}", _GPT2))),  # digits split one by one first
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan", "grok-2"), PreTokenizer((_QWEN2,))),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "minimax-m2"), PreTokenizer((_GPT4O,))),
)


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF file's tokenizer, ready for `Tokenizer`."""

    hf: HFTokenizer
    special_tokens: dict[str, str]  # template variable name -> token text
    eos_token_ids: frozenset[int]


def gguf_metadata(path: Path, source: Any = None) -> Mapping[str, Any]:
    """Metadata from parsed metadata, a `gguf.GGUFReader`, or (None) the file itself."""
    if source is None:
        # The project's header parser: gguf.GGUFReader takes seconds on a 100k-token vocabulary.
        from lmserve.loader.gguf_file import read_gguf

        return read_gguf(path).metadata
    if isinstance(source, Mapping):
        return source
    if hasattr(source, "fields"):
        return _reader_metadata(source)
    raise TypeError(f"expected a gguf.GGUFReader or a metadata mapping, got {type(source).__name__}")


def _reader_metadata(reader: Any) -> dict[str, Any]:
    """The tokenizer keys of a gguf.GGUFReader as plain Python values."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not name.startswith(("tokenizer.", "general.architecture")):
            continue
        is_str = field.types[-1] == GGUFValueType.STRING
        items = [bytes(field.parts[i]).decode("utf-8", "replace") if is_str else field.parts[i][0].item()
                 for i in field.data]
        meta[name] = items if field.types[0] == GGUFValueType.ARRAY else items[0]
    return meta


def build_from_gguf(meta: Mapping[str, Any], source: str) -> GGUFVocab:
    """The tokenizer a GGUF file describes; CheckpointError naming what is missing, malformed or unsupported."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise CheckpointError(f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level "
                              "BPE, 'llama' SentencePiece, 'bert' WordPiece, 't5' SentencePiece Unigram); serve the model's Hugging Face "
                              "directory instead")
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{source}: GGUF file has no tokenizer.ggml.tokens (no embedded tokenizer)")
    # Python loops over the 50k-260k tokens are kept to C-level calls here: each loop was 5-10 ms of every start
    tokens = list(map(str, meta["tokenizer.ggml.tokens"]))
    kinds = np.asarray(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)), dtype=np.int64)[:len(tokens)]
    types = kinds.tolist()
    gemma = kind == "llama" and str(meta.get("general.architecture", "")).startswith("gemma")
    hf, add_bos_default = (_gemma_bpe if gemma else _BUILDERS[kind])(meta, tokens, types, source)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _of_kind(tokens, kinds, CONTROL)])
    # user-defined pieces are matched whole, where the vocabulary spells them as the file does (not Gemma's spaces)
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in _of_kind(tokens, kinds, USER_DEFINED)
                   if hf.token_to_id(t) is not None])
    ids = {name: _token_id(meta, key, len(tokens)) for name, key in NAMED_IDS.items()}
    special = {name: tokens[i] for name, i in ids.items() if i is not None}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", kind == "t5"))  # llama.cpp's UGM default: an EOS
    bos, eos = ids["bos_token"], ids["eos_token"]
    if kind == "bert":
        sep = _token_id(meta, "tokenizer.ggml.seperator_token_id", len(tokens))  # llama.cpp's spelling of the key
        ids["sep_token"] = eos if sep is None else sep
        special |= {"cls_token": tokens[bos]} if bos is not None else {}
        special |= {"sep_token": tokens[ids["sep_token"]]} if ids["sep_token"] is not None else {}
        if bos is not None and ids["sep_token"] is not None:  # BERT's: [CLS] a [SEP], [CLS] a [SEP] b [SEP], b type 1
            set_pair_framing(hf, tokens, bos, ids["sep_token"], second_type=1)
    elif meta.get("general.architecture") in ENCODER_ARCHS and add_bos and add_eos and None not in (bos, eos):
        # an encoder's pair as llama.cpp frames it (its rerank prompt): BOS a EOS, SEP where add_sep_token, b EOS:
        # XLM-R's <s> a </s></s> b </s>, ModernBERT's [CLS] a [SEP] b [SEP]
        sep = _token_id(meta, "tokenizer.ggml.seperator_token_id", len(tokens))  # llama.cpp's spelling of the key
        ids["sep_token"] = eos if sep is None else sep
        special |= {"cls_token": tokens[bos], "sep_token": tokens[ids["sep_token"]]}
        # every token type 0: the encoders that come here have one type, or none
        set_pair_framing(hf, tokens, bos, eos, ids["sep_token"] if meta.get("tokenizer.ggml.add_sep_token") else None)
    else:
        set_bos_eos(hf, (tokens[bos], bos) if add_bos and bos is not None else None,
                    (tokens[eos], eos) if add_eos and eos is not None else None)
    eog = {i for key in EOG_KEYS if (i := _token_id(meta, key, len(tokens))) is not None}
    return GGUFVocab(hf, special, frozenset(eog | _ids_of(tokens, EOG_TEXTS)))


def _of_kind(tokens: list[str], kinds: np.ndarray, kind: int) -> list[str]:
    """The tokens of one token_type, in id order."""
    return [tokens[i] for i in np.flatnonzero(kinds == kind).tolist()]


def _ids_of(tokens: list[str], texts: frozenset[str]) -> set[int]:
    """Every id whose token is one of `texts` (a text spelled at two ids gives both)."""
    ids = set()
    for text in texts.intersection(tokens):
        at = tokens.index(text)
        while True:
            ids.add(at)
            try:
                at = tokens.index(text, at + 1)
            except ValueError:
                break
    return ids


def _token_id(meta: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    """A special-token id from the metadata; an id outside the vocabulary is ignored, as llama.cpp does."""
    value = meta.get(key)
    return int(value) if value is not None and 0 <= int(value) < n_tokens else None


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                    source: str) -> tuple[HFTokenizer, bool]:
    """A byte-level BPE tokenizer from vocab, merges and the named pre-tokenizer."""
    name = meta.get("tokenizer.ggml.pre", "default")  # files from before the key existed: GPT-2's split
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise CheckpointError(f"{source}: GGUF pre-tokenizer {name!r} is not supported "
                         f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if not merges or any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{source}: GGUF byte-level BPE vocabulary has missing or malformed merges")
    hf = HFTokenizer(_bpe(source, vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False,
                                ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf, pre.add_bos


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                       source: str) -> tuple[HFTokenizer, bool]:
    """A SentencePiece-BPE tokenizer with byte fallback from pieces, scores and types."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CheckpointError(f"{source}: GGUF SentencePiece vocabulary has no scores for its {len(tokens)} tokens")
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    merges = _cached_merges(source, lambda: merges_from_scores(tokens, scores, types))
    hf = HFTokenizer(_bpe(source, vocab=_vocab(tokens), merges=merges,
                                unk_token=tokens[0 if unk is None else unk], fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer runs once per run of text between added tokens, so the prefix space also follows
    # special tokens, as in llama.cpp (transformers' Metaspace "first" scheme adds it only at the start).
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE)] * prefix
                                         + [normalizers.Replace(" ", SPIECE_SPACE)])
    hf.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                   + [decoders.Strip(" ", 1, 0)] * prefix)
    return hf, True


def _gemma_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                source: str) -> tuple[HFTokenizer, bool]:
    """Gemma's SentencePiece BPE: byte fallback, spaces spelled "▁" with no prefix space, merges in file order."""
    # a piece of spaces is stored as real spaces ("  "), but text reaches the model spelled "▁▁"
    spelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = _vocab(spelled)
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    merges = _cached_merges(source, lambda: merges_by_position(spelled, vocab))
    hf = HFTokenizer(_bpe(source, vocab=vocab, merges=merges, fuse_unk=True,
                                unk_token=spelled[3 if unk is None else unk], byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    hf.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf, True


def _cached_merges(source: str, derive: Callable[[], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """`derive()`, or the merges it gave for this file at an earlier start (loader/start_cache.py): a
    SentencePiece-style file stores none, and deriving Gemma 3's took 1.8 CPU s of every start (~0.3 s read back)."""
    return cached(Path(source), ".merges", ("tokenizer/gguf_vocab.py",), derive, lambda kept: isinstance(kept, list))


def merges_by_position(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges of every piece that two pieces join into, the piece earlier in the vocabulary first (then the longer
    left part), as transformers derives them for a vocabulary whose order is its merge order."""
    last = {piece: index for index, piece in enumerate(tokens)}  # a piece spelled twice ranks by its last place
    merges = []
    for piece in sorted(last, key=last.__getitem__):  # emitted in rank order: no sort of the merges themselves
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def merges_from_scores(tokens: list[str], scores: Any, types: list[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece: any two pieces join into a piece, best-scored piece first.

    Only normal pieces take part: control, byte and unknown pieces never come out of a merge.
    """
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), -cut, cut - len(piece), left, right))
    ranked.sort(key=lambda r: r[:3])  # stable: ties keep vocabulary order
    return [(left, right) for *_, left, right in ranked]


def set_bos_eos(hf: HFTokenizer, bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> None:
    """Install a post-processor that adds BOS and/or EOS (token, id) around encoded text."""
    if bos is None and eos is None:
        return

    def sequence(part: str, type_id: int) -> str:
        pieces = [f"{bos[0]}:{type_id}"] if bos is not None else []
        pieces.append(f"${part}:{type_id}")
        return " ".join(pieces + ([f"{eos[0]}:{type_id}"] if eos is not None else []))

    hf.post_processor = processors.TemplateProcessing(
        single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
        special_tokens=[t for t in (bos, eos) if t is not None])


def _unigram(meta: Mapping[str, Any], tokens: list[str], types: list[int],
             source: str) -> tuple[HFTokenizer, bool]:
    """SentencePiece Unigram as llama.cpp's llm_tokenizer_ugm runs it: the Viterbi over the whole normalised text
    (no pre-tokenizer: llama.cpp splits none), an unknown code point scored the lowest normal piece's score - 10
    and a run of them fused into one <unk>. Keys absent take llama.cpp's defaults (no space prefix, no merging of
    spaces; it reads no treat_whitespace_as_suffix key)."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CheckpointError(f"{source}: GGUF Unigram vocabulary has no scores for its {len(tokens)} tokens")
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    if unk is None:
        raise CheckpointError(f"{source}: GGUF Unigram vocabulary names no unknown token")
    kinds = np.asarray(types + [NORMAL] * (len(tokens) - len(types)))
    score = np.asarray(scores, dtype=np.float64)
    normal = score[kinds == NORMAL]
    if normal.size == 0:
        raise CheckpointError(f"{source}: GGUF Unigram vocabulary has no normal pieces")
    # `tokenizers` scores an unknown code point at the lowest score of its whole vocabulary - 10, llama.cpp at the
    # lowest normal piece's - 10: the pieces llama.cpp never matches (control, unknown, byte; control ones are
    # split off whole before the model anyway) are raised to that score so that both lowest scores agree. (A
    # vocabulary with unused pieces scored below every normal one still lowers it: the converter's -10000 fillers.)
    outside = np.isin(kinds, (UNKNOWN, CONTROL, 6))
    score[outside] = np.maximum(score[outside], normal.min())
    hf = HFTokenizer(_made(source, "a Unigram model", lambda: models.Unigram(list(zip(tokens, score.tolist())),
                                                                              unk_id=unk, byte_fallback=False)))
    steps = []
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap):
        blob = np.asarray(charsmap, dtype=np.uint8).tobytes()
        steps.append(_made(source, "its precompiled charsmap", lambda: normalizers.Precompiled(blob)))
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", False):
        # every run of non-space text gets one "▁" before it (with or without add_space_prefix), spaces go
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" +"), SPIECE_SPACE),
                  normalizers.Prepend(SPIECE_SPACE)]
    else:  # each space a "▁"; the prefix "▁" (a text of spaces alone gets one too, which llama.cpp's does not)
        steps += [normalizers.Replace(" ", SPIECE_SPACE)]
        steps += [normalizers.Prepend(SPIECE_SPACE)] * bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    hf.normalizer = normalizers.Sequence(steps)
    hf.decoder = decoders.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="always", split=True)
    return hf, False  # llama.cpp's UGM defaults (T5's): no BOS, an EOS (`build_from_gguf`), no prefix space


def _wordpiece(meta: Mapping[str, Any], tokens: list[str], types: list[int],
               source: str) -> tuple[HFTokenizer, bool]:
    """BERT's WordPiece from llama.cpp's phantom-space spelling: "▁word" was "word", a bare "piece" was "##piece",
    control tokens ([CLS], [SEP], ...) are as they were. Texts are cleaned, split and lowercased as BERT does
    (`tokenizer.ggml.normalizer.lowercase`; accents stripped with lowercasing unless the file says otherwise)."""
    types = types + [NORMAL] * (len(tokens) - len(types))  # a short token_type array: the rest are normal
    spelled = [t if k == CONTROL else t[1:] if t.startswith(SPIECE_SPACE) else "##" + t for t, k in zip(tokens, types)]
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    if unk is None:
        raise CheckpointError(f"{source}: GGUF WordPiece vocabulary names no unknown token")
    hf = HFTokenizer(models.WordPiece(_vocab(spelled), unk_token=spelled[unk], max_input_chars_per_word=100))
    lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    strip = meta.get("tokenizer.ggml.normalizer.strip_accents")
    hf.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=lower,
                                               strip_accents=None if strip is None else bool(strip))
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    return hf, True


def set_pair_framing(hf: HFTokenizer, tokens: list[str], start: int, end: int, mid: int | None = None,
                     second_type: int = 0) -> None:
    """An encoder's framing, as llama.cpp adds it: `start` a `end` for one text, `start` a `end` [`mid`] b `end` for
    a pair, b and its `end` of token type `second_type` (everything before them type 0)."""
    s, e = tokens[start], tokens[end]
    between = f" {tokens[mid]}" if mid is not None else ""
    named = {s: start, e: end} | ({tokens[mid]: mid} if mid is not None else {})
    hf.post_processor = processors.TemplateProcessing(
        single=f"{s} $A {e}", pair=f"{s} $A {e}{between} $B:{second_type} {e}:{second_type}",
        special_tokens=list(named.items()))


def _bpe(source: str, **kwargs: Any) -> models.BPE:
    """`models.BPE(**kwargs)`; `tokenizers` raises a plain Exception for a merge of pieces outside the vocabulary."""
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # noqa: BLE001 - the only type it raises
        raise CheckpointError(f"{source}: the GGUF vocabulary cannot make a BPE model ({str(e)[:200]})") from None


def _made(source: str, what: str, make: Callable[[], Any]) -> Any:
    """`make()`, a `tokenizers` object; the plain Exception it raises on malformed input a CheckpointError."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - the only type it raises
        raise CheckpointError(f"{source}: the GGUF vocabulary cannot make {what} ({str(e)[:200]})") from None


def _vocab(tokens: list[str]) -> dict[str, int]:
    return dict(zip(tokens, range(len(tokens))))  # a token spelled twice maps to its last id


_BUILDERS: dict[str, Callable[[Mapping[str, Any], list[str], list[int], str], tuple[HFTokenizer, bool]]] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
    "bert": _wordpiece,
    "t5": _unigram,
}
