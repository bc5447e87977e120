"""Pooling (embedding) requests: how the final hidden states of a prompt become one vector (plain data).

A pooling request runs its prompt through the same scheduler as a generation (chunked prefill, prefix
hits for last-token pooling) and finishes when the prompt's last chunk has run: no decode, no sampling,
its KV blocks freed at once. What it pools is the model's, not the request's: `PoolerConfig` (from a
sentence-transformers checkpoint's files or `--pooling`); what the request chooses is vLLM's
`PoolingParams`: how many dimensions to keep and whether to L2-normalise.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean", "cls", "max")
# vLLM's default for decoder LMs: the last token is the only one that attended to the whole prompt
DEFAULT_POOLING = "last"


@dataclass(frozen=True)
class PoolingParams:
    """What one embedding request asks: keep the first `dimensions` components (Matryoshka; None: all), then
    L2-normalise when `normalize` (OpenAI's and Ollama's /api/embed vectors are unit length)."""

    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """The model's pooling: `method` (last | mean | cls) and where it was read from (for the start-up log)."""

    method: str = DEFAULT_POOLING
    source: str = "default"
    normalize: bool = True  # the checkpoint's own output is unit length (sentence-transformers' Normalize module)
    encoder: bool = False  # an encoder (models/bert.py): pools, never generates
    num_labels: int = 0  # a classification head's outputs (0: an embedder); its vector is the head's activated scores
    max_seq_length: int | None = None  # sentence-transformers' window (sentence_bert_config.json), under the model's
    labels: tuple[str, ...] = ()  # a classifier's label names (config.json's id2label), by index

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")

    @property
    def needs_every_token(self) -> bool:
        """Mean, max and CLS read hidden states a prefix-cache hit would skip: such prompts compute every token (an
        encoder's always do: each token's state depends on the tokens after it)."""
        return self.method != "last" or self.encoder

    @property
    def tasks(self) -> tuple[str, ...]:
        """What the model answers (vLLM's task names): a decoder generates and embeds; an embedder embeds and scores
        pairs by cosine (score, rerank); a cross-encoder (one label) scores pairs by its head; a classifier classifies."""
        if not self.encoder:  # a decoder; one with a token-pair head (--classifier-from-token) scores pairs too
            return ("generate", "score", "rerank", "classify") if self.num_labels else ("generate", "embed")
        if self.num_labels == 0:
            return ("embed", "score", "rerank")
        return ("score", "rerank", "classify") if self.num_labels == 1 else ("classify",)
