"""The request bodies of the retrieval routes (server/api/retrieval.py), as their clients send them.

Rerank: Jina's and Cohere's `{query, documents, top_n, return_documents}` (documents as strings or `{"text": ...}`),
served on /v1/rerank, /rerank and Cohere v2's /v2/rerank (as vLLM serves them), Cohere v2's `max_tokens_per_doc`
honoured; TEI's `{query, texts, raw_scores, return_text, truncate}`
on /rerank too, told apart by its `texts`. Score: vLLM's `{text_1, text_2}`. Classify: vLLM's `{input}`. TEI's
`/embed`: `{inputs, normalize, truncate, dimensions}`. `truncate_prompt_tokens` (vLLM) cuts each input to that
many tokens; without it an input past the model's window is a 400.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmserve.server.protocol import _NullMeansDefault


class TextDocument(_NullMeansDefault):
    """A document as an object (Jina, Cohere v2): its text."""

    text: str


class RerankRequest(_NullMeansDefault):
    """Jina / Cohere rerank: the documents ordered by relevance to `query`, the best `top_n` (0 or absent: all)."""

    model: str | None = None
    query: str
    documents: list[str | TextDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    max_chunks_per_doc: int | None = None  # Cohere v1's; accepted, each document is one chunk
    # Cohere v2's: each document cut to this many tokens before it is scored (the pair must still fit the window)
    max_tokens_per_doc: int | None = Field(default=None, ge=1)


class TEIRerankRequest(_NullMeansDefault):
    """TEI's /rerank: one score per text, sorted best first; `raw_scores`: the head's logit, not its sigmoid."""

    model: str | None = None
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = False
    truncation_direction: Literal["Right", "right"] = "Right"


class ScoreRequest(_NullMeansDefault):
    """vLLM's /v1/score: text_1 against text_2, one to one (equal lists) or one to many (text_1 one text)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    encoding_format: Literal["float"] = "float"
    user: str | None = Field(default=None, max_length=256)


class ClassifyRequest(_NullMeansDefault):
    """vLLM's /classify: each input's label probabilities."""

    model: str | None = None
    input: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)


class TEIEmbedRequest(_NullMeansDefault):
    """TEI's /embed: `inputs` a string or a list; unit vectors unless `normalize` is false."""

    model: str | None = None
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False
    truncation_direction: Literal["Right", "right"] = "Right"
    dimensions: int | None = Field(default=None, ge=1)
    prompt_name: str | None = None
