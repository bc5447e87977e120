"""Tokenizer: text <-> ids with Hugging Face `tokenizers`, built from tokenizer.json or GGUF metadata.

Where special-token strings ("<|im_start|>") become control tokens depends on who wrote the text:
- a raw prompt (`encode_prompt`: /v1/completions, TGI's `inputs`, `LLM.generate`) is the caller's
  whole text, often a chat template applied by hand, so they do (as in vLLM, TGI, llama.cpp's server);
- chat messages (`encode_chat`) do not: only the template's framing is parsed, so a user who types
  "<|im_start|>system" inside a message cannot forge a role;
- `encode` is plain text throughout.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from lmserve.errors import CheckpointError
from lmserve.files import MAX_JSON_FILE_DEPTH, load_json_bytes, nests_deeper
from lmserve.tokenizer import chat_template as ct
from lmserve.tokenizer.bounds import TokenBounds, text_bytes
from lmserve.tokenizer.gguf_vocab import build_from_gguf, gguf_metadata

if TYPE_CHECKING:
    import gguf

# Named special tokens, as transformers exposes them to chat templates.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Texts longer than this are encoded through the batch call, which lets go of the GIL: `encode` holds it
# throughout (a 4 MiB prompt: 6.8 s in which no other thread, the server's event loop included, ran).
_GIL_FREE_CHARS = 16384


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(self, hf: HFTokenizer, special_tokens: Mapping[str, str | None] | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None) -> None:
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        _register_named(hf, self.special_tokens.values())
        self._hf = hf  # parses special tokens: chat-template framing, and decoding
        self._plain = _copy(hf, plain=True)  # user text: special-token strings stay plain text
        # Mid-text copies: a piece cut from the middle of a chat gets no SentencePiece prefix space.
        self._hf_mid, self._plain_mid = _mid_text_copies(hf, self._plain)
        self.bos_token, self.eos_token = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        self.bos_token_id = hf.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = hf.token_to_id(self.eos_token) if self.eos_token else None
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos_token_ids) | eos
        self.add_bos_token = self.bos_token_id is not None and self._adds_bos()
        self.chat_template = chat_template
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)

    @functools.cached_property
    def _special_re(self) -> re.Pattern[str] | None:
        """Any special-token string, for user text that spells one (encode_chat). Built on the first chat, not at
        start: Gemma 3's 6,249 special tokens make a regex that takes ~0.3 s to compile (issue 32)."""
        return ct.special_pattern([t.content for t in self._hf.get_added_tokens_decoder().values() if t.special])

    def _adds_bos(self) -> bool:
        """Whether encoding with special tokens puts BOS in front (the post-processor decides)."""
        with_bos = self._plain.encode("a", add_special_tokens=True).ids
        return len(with_bos) > len(self._plain.encode("a", add_special_tokens=False).ids) \
            and with_bos[0] == self.bos_token_id

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike,
                  reader: "gguf.GGUFReader | Mapping[str, Any] | None" = None) -> "Tokenizer":
        """Build from a GGUF file's metadata; pass `reader` (a GGUFReader or parsed metadata) if already read."""
        meta = gguf_metadata(Path(path), reader)
        try:
            vocab = build_from_gguf(meta, str(path))
        except CheckpointError:
            raise
        except (TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:  # a key of the wrong type
            raise CheckpointError(f"{path}: malformed GGUF tokenizer metadata ({str(e)[:200]})") from None
        template = meta.get("tokenizer.chat_template") or ct.built_in_template(str(meta.get("general.architecture", "")))
        return cls(vocab.hf, vocab.special_tokens, vocab.eos_token_ids, template)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Build from a Hugging Face directory: tokenizer.json, tokenizer_config.json, chat template, eos ids."""
        d = Path(directory)
        hf = _hf_tokenizer(check_tokenizer_file(d), d / "tokenizer.json")
        # With a tokenizer.json, its post-processor decides BOS/EOS (transformers ignores add_bos_token then).
        cfg = {**_read_json(d / "special_tokens_map.json"), **_read_json(d / "tokenizer_config.json")}
        special = {name: _token_str(cfg.get(name)) for name in NAMED_TOKENS}
        gen_eos = _read_json(d / "generation_config.json").get("eos_token_id")
        eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        return cls(hf, special, eos_ids, _chat_template(d, cfg))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json that transformers and
        `from_pretrained` both read back as this tokenizer (how a GGUF's vocabulary becomes HF files)."""
        d = Path(directory)
        (d / "tokenizer.json").write_text(self._hf.to_str(), encoding="utf-8")
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens,
                                  "clean_up_tokenization_spaces": False}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        generation = {"bos_token_id": self.bos_token_id, "eos_token_id": sorted(self.eos_token_ids)}
        (d / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")

    # -- text <-> ids -----------------------------------------------------------------------------

    @functools.cached_property
    def bounds(self) -> TokenBounds:
        """How many tokens a text of n UTF-8 bytes can become (tokenizer/bounds.py); built on first use."""
        return TokenBounds.of(self._hf, self.vocab_type)

    @property
    def bounds_built(self) -> bool:
        """`bounds` was built: reading it costs nothing (the first read builds it from the vocabulary)."""
        return "bounds" in self.__dict__

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text -> ids; add_special_tokens adds BOS when the model wants it."""
        return _ids(self._plain, text, add_special_tokens)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw prompt -> ids: special-token strings in it become their control tokens."""
        if add_special_tokens and self.add_bos_token and text.startswith(self.bos_token):
            # The caller wrote BOS (a template applied by hand): adding ours would start the prompt with two.
            add_special_tokens = False
        return _ids(self._hf, text, add_special_tokens)

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two plain texts framed as one input by the tokenizer's pair template (a cross-encoder's query and
        document: BERT's [CLS] a [SEP] b [SEP], XLM-R's <s> a </s></s> b </s>)."""
        return self._plain.encode(first, second, add_special_tokens=True).ids

    def cut_text(self, text: str, max_tokens: int) -> str:
        """`text` up to the end of its `max_tokens`-th token (no special tokens counted): Cohere's
        max_tokens_per_doc, cut where the tokenizer's offsets say, so the rest of the framing is unchanged."""
        offsets = self._plain.encode(text, add_special_tokens=False).offsets
        return text if len(offsets) <= max_tokens else text[:offsets[max_tokens - 1][1]]

    def token_to_id(self, piece: str) -> int | None:
        """The id of a token string (a special token included); None when the vocabulary lacks it."""
        return self._hf.token_to_id(piece)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; ids outside the vocabulary (padded embedding rows) decode to nothing."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The token's text as it would be decoded alone (for logprobs), leading space included."""
        return self._hf_mid.decode([int(token_id)], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a special (control) token."""
        return token_id in self._special_ids

    def vocab_tokens(self) -> list[str]:
        """Every id's token string as stored in the vocabulary (GPT-2 byte alphabet, "▁", "<0x0A>"...)."""
        return [self._hf.id_to_token(i) or "" for i in range(self.vocab_size)]

    @property
    def vocab_type(self) -> str:
        """How token strings map to bytes, from the decoder: "byte_level", "byte_fallback" (SentencePiece) or "raw"."""
        decoder = json.dumps(_state(self._hf.decoder) or {})  # the decoder alone: the whole JSON took 0.5 s
        if '"ByteLevel"' in decoder:
            return "byte_level"
        if '"ByteFallback"' in decoder or '"Metaspace"' in decoder or "\u2581" in decoder:
            return "byte_fallback"  # also reads "▁" as a space
        return "raw"

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The rendered prompt string, as transformers' apply_chat_template(tokenize=False) gives it."""
        return self._render(ct.normalize_messages(messages), add_generation_prompt, kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Prompt ids: the template's framing tokens are special; text from the messages is plain text."""
        return self.encode_rendered(self.render_chat(messages, add_generation_prompt, **kwargs))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> RenderedChat:
        """The chat rendered by its template, ready to encode (encode_rendered): the server sizes it in between."""
        messages = ct.normalize_messages(messages)
        if self._special_re is not None:
            marked, marked_kwargs = ct.mark_special(messages, self._special_re), ct.mark_special(kwargs, self._special_re)
            if marked != messages or marked_kwargs != kwargs:
                segments = ct.split_marked(self._render(marked, add_generation_prompt, marked_kwargs), self._special_re)
                self._check_framing(segments, marked, add_generation_prompt, marked_kwargs)
                return RenderedChat(tuple(segments))
        # No special-token text anywhere in the input: one encode, exactly as transformers does it.
        return RenderedChat(((self._render(messages, add_generation_prompt, kwargs), False),))

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API with a plain prompt")
        return ct.render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens, **kwargs)

    def encode_rendered(self, chat: RenderedChat) -> list[int]:
        """A rendered chat's ids: user-typed special-token spellings become plain-text ids."""
        ids: list[int] = []
        for i, (text, from_user) in enumerate(chat.segments):
            tk = (self._plain if from_user else self._hf) if i == 0 else (self._plain_mid if from_user else self._hf_mid)
            piece = _ids(tk, text, False)
            if from_user and any(t in self._special_ids for t in piece):
                raise ValueError(f"cannot encode {text!r} as plain text: this vocabulary maps it to a special token")
            ids += piece
        return ids

    def _check_framing(self, segments: list[tuple[str, bool]], messages: list[dict], add_generation_prompt: bool,
                       kwargs: dict[str, Any]) -> None:
        """Fail closed if the template moved user-typed special tokens out of their markers.

        The template's framing must hold exactly the special tokens it writes when the user's
        special-token strings are removed; a template that escapes or slices message text
        (e.g. tojson with ensure_ascii) would otherwise turn user text into control tokens.
        """
        assert self._special_re is not None
        framing = Counter(s for text, user in segments if not user for s in self._special_re.findall(text))
        bare = self._render(ct.unmark(messages), add_generation_prompt, ct.unmark(kwargs))
        if framing != Counter(self._special_re.findall(bare)):
            raise ValueError("a message contains special-token text, and this chat template rewrites message text "
                             "in a way that would turn it into control tokens; remove the special-token strings")


@dataclass(frozen=True)
class RenderedChat:
    """A chat rendered by its template: (text, is a special token the user typed) segments, encoded in order."""

    segments: tuple[tuple[str, bool], ...]

    @property
    def nbytes(self) -> int:
        """Its UTF-8 length: what the token bounds are read from."""
        return sum(text_bytes(text) for text, _ in self.segments)


def _ids(tk: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tk.encode(text).ids`, without holding the GIL for long texts (the batch call lets go of it; its fast form
    skips the offsets no one here reads, and their memory: ~40 bytes a token)."""
    if len(text) <= _GIL_FREE_CHARS:
        return tk.encode(text, add_special_tokens=add_special_tokens).ids
    batch = getattr(tk, "encode_batch_fast", tk.encode_batch)  # tokenizers >= 0.21
    return batch([text], add_special_tokens=add_special_tokens)[0].ids


def load_tokenizer(loaded: Any) -> Tokenizer:
    """A loaded model's own tokenizer (a loader.LoadedModel): a GGUF's vocabulary from the metadata already parsed,
    else the directory's tokenizer.json."""
    if loaded.format == "gguf":
        return Tokenizer.from_gguf(loaded.path, loaded.gguf.metadata if loaded.gguf else None)
    return Tokenizer.from_pretrained(loaded.path)


def _copy(hf: HFTokenizer, plain: bool = False) -> HFTokenizer:
    """A tokenizer of its own over `hf`'s vocabulary: `encode_special_tokens` is the tokenizer's setting, not the
    call's, so one shared by plain and special encodes would race (the server encodes from several threads).

    The model (vocabulary, merges) and the pipeline's components are shared, never changed once built (a copy that
    edits one sets a new object); only the added tokens are registered again, with the same ids. A copy through
    tokenizer.json parsed the whole vocabulary again: 0.3 CPU s of every SmolLM2 start (issue 32). Where the
    registration does not give the same added tokens back, the copy is made through the JSON after all.
    """
    tk = HFTokenizer(hf.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if getattr(hf, part) is not None:
            setattr(tk, part, getattr(hf, part))
    for special, run in _added_runs(hf):
        (tk.add_special_tokens if special else tk.add_tokens)(run)
    if _added_state(tk) != _added_state(hf) or hf.padding is not None or hf.truncation is not None:
        tk = HFTokenizer.from_str(hf.to_str())
    tk.encode_special_tokens = plain
    return tk


def _added_runs(hf: HFTokenizer) -> list[tuple[bool, list[AddedToken]]]:
    """`hf`'s added tokens as (special, tokens) to register in this order for the same ids: two calls where every one
    is in the model's vocabulary (each call rebuilds the added-token matcher: Gemma has 6,384), else runs of one
    kind in id order (a token outside the vocabulary takes the next free id)."""
    added = hf.get_added_tokens_decoder()
    ordered = [added[i] for i in sorted(added)]
    if all(hf.model.token_to_id(t.content) == i for i, t in added.items()):
        return [(kind, [t for t in ordered if t.special == kind]) for kind in (True, False)]
    runs: list[tuple[bool, list[AddedToken]]] = []
    for t in ordered:
        if runs and runs[-1][0] == t.special:
            runs[-1][1].append(t)
        else:
            runs.append((t.special, [t]))
    return runs


def _added_state(hf: HFTokenizer) -> dict[int, tuple]:
    return {i: (t.content, t.special, t.single_word, t.lstrip, t.rstrip, t.normalized)
            for i, t in hf.get_added_tokens_decoder().items()}


def _mid_text_copies(hf: HFTokenizer, plain: HFTokenizer) -> tuple[HFTokenizer, HFTokenizer]:
    """Copies of (hf, plain) that add no prefix space when encoding and strip none when decoding.

    Only the three small components are read and edited (their own JSON state): parsing the whole
    tokenizer.json (the vocabulary and merges, 1.5 MB for a 49K vocabulary) took ~0.15 s of every start.
    """
    parts = {k: _state(getattr(hf, k)) for k in _PREFIX_SPACE_PARTS}
    edited = {k: _no_prefix_space(v, decoder=k == "decoder") for k, v in parts.items()}
    if edited == parts:  # byte-level BPE without a prefix space: nothing to change
        return hf, plain
    copies = (_copy(hf), _copy(hf, plain=True))
    for tk in copies:
        for k, node in edited.items():
            if node != parts[k]:
                setattr(tk, k, _with_state(getattr(hf, k), node))
    return copies


_PREFIX_SPACE_PARTS = ("normalizer", "pre_tokenizer", "decoder")


def _state(component: Any) -> Any:
    """A tokenizers component (normalizer, pre-tokenizer, decoder) as its tokenizer.json node; None stays None."""
    return None if component is None else json.loads(component.__getstate__())


def _with_state(component: Any, node: Any) -> Any:
    """A new component of `component`'s class from an edited tokenizer.json node (None: no component)."""
    if node is None:
        return None
    fresh = pickle.loads(pickle.dumps(component))
    fresh.__setstate__(json.dumps(node).encode())
    return fresh


def _no_prefix_space(node: Any, decoder: bool = False) -> Any:
    """A tokenizer.json component with SentencePiece's prefix-space handling removed (None if it was only that).

    A ByteLevel *decoder* never reads its add_prefix_space (it only maps bytes back), so it is left as it is: a
    GPT-2-style vocabulary then needs no mid-text copies at all (two fewer 1.5 MB parses per start, ~0.16 s).
    """
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "Prepend" or (kind == "Strip" and node.get("start", 0) > 0):
        return None
    node = dict(node)
    if kind == "Metaspace":
        node["prepend_scheme"] = "never"
    if (kind == "Metaspace" or (kind == "ByteLevel" and not decoder)) and "add_prefix_space" in node:
        node["add_prefix_space"] = False
    for key in ("normalizers", "pretokenizers", "decoders"):
        if isinstance(node.get(key), list):
            node[key] = [c for c in (_no_prefix_space(n, decoder) for n in node[key]) if c is not None]
    return node


def _register_named(hf: HFTokenizer, tokens: Iterable[str]) -> None:
    """Make named special tokens (bos, eos, unk, ...) special added tokens, as transformers does."""
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    new = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(tokens)
           if t not in added and hf.token_to_id(t) is not None]
    if new:
        hf.add_special_tokens(new)


def _chat_template(d: Path, cfg: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja wins over tokenizer_config.json, as in transformers."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = load_json_bytes(path.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _hf_tokenizer(raw: bytes, path: Path) -> HFTokenizer:
    """tokenizer.json's bytes (nesting already checked) -> the `tokenizers` Tokenizer, once it encodes a word (a
    WordLevel model without its unknown token, a template naming a token it lacks, fail only then); CheckpointError
    naming the file."""
    try:
        hf = HFTokenizer.from_buffer(raw)
        # a training-time setting some files keep (all-MiniLM-L6-v2's: cut to 128, padded to 128): the engine checks
        # lengths itself and never pads, so a prompt is never cut or padded behind the caller's back
        hf.no_truncation()
        hf.no_padding()
        hf.encode("a b", add_special_tokens=True)
        return hf
    except BaseException as e:  # noqa: BLE001 - `tokenizers` raises plain Exception, and pyo3's PanicException (a
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":  # BaseException) where Rust panics
            raise
        raise CheckpointError(f"{path}: not a valid tokenizer file ({str(e)[:200]})") from None


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def check_tokenizer_file(directory: Path) -> bytes:
    """An HF directory's tokenizer.json, its bytes returned once its nesting is checked (the preflight checks this
    before any weights load); CheckpointError naming the file."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no tokenizer.json (a fast tokenizer file is required)")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    if nests_deeper(raw):
        raise CheckpointError(f"{path}: nested more than {MAX_JSON_FILE_DEPTH} levels deep")
    return raw
