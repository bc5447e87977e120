"""How many tokens a text can become, known from its UTF-8 length alone: the server's limits are checked with these
bounds before it tokenizes anything (tokenizing 4 MiB takes seconds; counting its bytes takes nothing).

Upper bound. Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) starts from one token per byte and merges only join
tokens, so a text of B bytes is at most B tokens; SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma)
gives every character one piece or one token per byte, plus the "▁" prefix space it may put before each run of
text, so at most 2B. The post-processor's BOS/EOS come on top. A normalizer that expands text (NFKC) could pass
the bound: it only sizes a reservation that the exact count settles, so such a miss costs nothing but precision.

Lower bound. One token covers at most `max_token_bytes` bytes of the input: the longest vocabulary entry's UTF-8
length, which for byte-level BPE is exactly the bytes it stands for (one character per byte) and for SentencePiece
at least that ("▁" is three bytes standing for one space, "<0x0A>" six for one). So a text of B bytes is at least
ceil(B / max_token_bytes) tokens; it is what refuses a request without tokenizing it, so it must never be too high.
It holds only when nothing can make one token cover more input than its own spelling: no normalizer that can
shrink text (NFC composes three bytes into two, Strip deletes), no pre-tokenizer that drops text (Whitespace),
no added token that swallows the whitespace around it (lstrip/rstrip), no unknown token standing for a whole word
(WordPiece) or a fused run. Where any of these is present there is no lower bound (`max_token_bytes` None) and the
request is tokenized (off the event loop) before its size and quota are known.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

# Normalizer and pre-tokenizer kinds that never remove input or shrink its bytes (Replace is checked on its own).
_KEEPS_BYTES = {"Prepend", "Sequence", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Replace"}


def text_bytes(text: str) -> int:
    """The UTF-8 length of `text` (lone surrogates, which JSON lets through, counted as their 3 bytes)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class TokenBounds:
    """The token count of a text of n UTF-8 bytes lies in [lower(n), upper(n)]."""

    max_token_bytes: int | None  # the most input bytes one token stands for; None: no lower bound
    tokens_per_byte: int  # 1 for byte-level BPE, 2 otherwise (see the module docstring)
    added: int  # tokens the post-processor adds around a single text (BOS, EOS)

    def lower(self, nbytes: int) -> int:
        """At least this many tokens (0 when there is no lower bound)."""
        return 0 if self.max_token_bytes is None else math.ceil(nbytes / self.max_token_bytes)

    def upper(self, nbytes: int) -> int:
        """At most this many tokens (exceeded only by an expanding normalizer, see above)."""
        return nbytes * self.tokens_per_byte + self.added

    @classmethod
    def of(cls, hf: HFTokenizer, vocab_type: str) -> TokenBounds:
        """The bounds of a tokenizer (`vocab_type`: Tokenizer.vocab_type)."""
        post = hf.post_processor
        added = post.num_special_tokens_to_add(False) if post is not None else 0
        return cls(_max_token_bytes(hf, vocab_type), 1 if vocab_type == "byte_level" else 2, added)


def _max_token_bytes(hf: HFTokenizer, vocab_type: str) -> int | None:
    """The most input bytes one token stands for, or None where that has no bound (see the module docstring)."""
    model = hf.model
    if vocab_type not in ("byte_level", "byte_fallback") or not isinstance(model, models.BPE) or model.fuse_unk \
            or not (vocab_type == "byte_level" or model.byte_fallback):
        return None
    if not all(_keeps_bytes(_state(getattr(hf, part))) for part in ("normalizer", "pre_tokenizer")):
        return None
    added = hf.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip for t in added):
        return None
    vocab = hf.get_vocab(with_added_tokens=False)
    spelled = (len(t) if vocab_type == "byte_level" else len(t.encode("utf-8", "surrogatepass")) for t in vocab)
    return max(max(spelled, default=1), max((len(t.content.encode("utf-8")) for t in added), default=1), 1)


def _state(component: Any) -> Any:
    return None if component is None else json.loads(component.__getstate__())


def _keeps_bytes(node: Any) -> bool:
    """A normalizer or pre-tokenizer (its tokenizer.json node) that neither drops input nor shrinks its bytes."""
    if node is None:
        return True
    if not isinstance(node, dict) or node.get("type") not in _KEEPS_BYTES or node.get("behavior") == "Removed":
        return False
    if node["type"] == "Replace":  # " " -> "▁" grows; a replacement shorter than what it replaces shrinks
        pattern = (node.get("pattern") or {}).get("String")
        return pattern is not None and len(node.get("content", "").encode()) >= len(pattern.encode())
    parts = node.get("normalizers") or node.get("pretokenizers") or []
    return all(_keeps_bytes(p) for p in parts)
