"""Tokenizer: text <-> ids with Hugging Face `tokenizers`, from tokenizer.json or GGUF metadata.

User text is always encoded with special-token parsing off: a prompt containing "<|im_start|>"
gets the ids of those characters, never the control token. Only chat-template framing (trusted
structure around the messages) is parsed for special tokens.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from lmserve.engine.chat_template import message_text, render_chat

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` (applied in order, each isolating its matches).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": [_GPT2], "gpt2": [_GPT2], "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2], "codeshell": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3], "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2],
}
CONTROL, USER_DEFINED = 3, 4  # GGUF token_type values


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(self, tk: HFTokenizer, bos_token: str | None, eos_token: str | None, eos_token_ids: frozenset[int],
                 chat_template: str | None, add_bos_token: bool) -> None:
        self._framing = tk  # parses special tokens (chat-template structure only)
        self._plain = HFTokenizer.from_str(tk.to_str())
        self._plain.encode_special_tokens = True  # user text: special-token strings stay plain text
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tk.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tk.token_to_id(eos_token) if eos_token else None
        self.eos_token_ids = frozenset(eos_token_ids | ({self.eos_token_id} if self.eos_token_id is not None else set()))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._special_ids = frozenset(i for i, t in tk.get_added_tokens_decoder().items() if t.special)
        self._special_strings = [t.content for t in tk.get_added_tokens_decoder().values() if t.special]

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, metadata: dict[str, Any] | None = None) -> "Tokenizer":
        """Build from GGUF metadata (pass `metadata` when the file was already parsed)."""
        if metadata is None:
            from lmserve.loader.gguf_file import read_gguf

            metadata = read_gguf(Path(path)).metadata
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported yet (supported: 'gpt2' "
                             "byte-level BPE); serve the model's Hugging Face directory instead")
        tk = _byte_level_bpe(metadata, str(path))
        tokens = list(metadata["tokenizer.ggml.tokens"])
        bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        eot = metadata.get("tokenizer.ggml.eot_token_id")
        extra_eos = frozenset(int(i) for i in (eos, eot) if i is not None)
        bos_tok = tokens[int(bos)] if bos is not None else None
        if add_bos and bos_tok is not None:
            tk.post_processor = processors.TemplateProcessing(single=f"{bos_tok} $A", pair=f"{bos_tok} $A $B",
                                                              special_tokens=[(bos_tok, int(bos))])
        return cls(tk, bos_tok, tokens[int(eos)] if eos is not None else None, extra_eos,
                   metadata.get("tokenizer.chat_template"), add_bos)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Build from a Hugging Face directory: tokenizer.json, tokenizer_config.json, chat template, eos ids."""
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"{d}: no tokenizer.json (a fast tokenizer file is required)")
        tk = HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        gen_eos = _read_json(d / "generation_config.json").get("eos_token_id")
        eos_ids = frozenset(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        return cls(tk, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")), eos_ids, template,
                   bool(cfg.get("add_bos_token", False)))

    # -- text <-> ids -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text -> ids; add_special_tokens adds BOS when the model wants it."""
        return self._plain.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._framing.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The token's text as it would be decoded alone (for logprobs)."""
        return self._framing.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The rendered prompt string, as transformers' apply_chat_template(tokenize=False) gives it."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API with a plain prompt")
        return render_chat(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Template framing parsed for special tokens; message contents encoded as plain text."""
        contents = [message_text(m) for m in messages]
        if not any(s in c for c in contents for s in self._special_strings):
            text = self.apply_chat_template(messages, add_generation_prompt)
            return self._framing.encode(text, add_special_tokens=False).ids
        return self._encode_chat_escaped(messages, contents, add_generation_prompt)

    def _encode_chat_escaped(self, messages: list[dict], contents: list[str], add_generation_prompt: bool) -> list[int]:
        """Render with sentinels in place of contents, then encode each content as plain text."""
        marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        text = self.apply_chat_template(marked, add_generation_prompt)
        parts = re.split(r"\ue000(\d+)\ue001", text)
        if len(parts) != 2 * len(messages) + 1:
            raise ValueError("the chat template alters message contents, so special-token text in a message "
                             "cannot be kept plain; remove special-token strings from the messages")
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self._plain.encode(contents[int(part)], add_special_tokens=False).ids
            elif part:
                ids += self._framing.encode(part, add_special_tokens=False).ids
        return ids


def _byte_level_bpe(meta: dict[str, Any], source: str) -> HFTokenizer:
    """A byte-level BPE tokenizer from GGUF vocab, merges and pre-tokenizer name."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEXES:
        raise ValueError(f"{source}: pre-tokenizer {pre!r} is not supported "
                         f"(supported: {', '.join(sorted(PRE_TOKENIZER_REGEXES))})")
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3")))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_REGEXES[pre]]
    tk.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tk.add_special_tokens(special)
    tk.add_tokens(user)
    return tk


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None
