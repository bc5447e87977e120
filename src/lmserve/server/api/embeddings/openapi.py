"""The OpenAPI rows of the embeddings routes, and the models of their answers. Ollama's two add 403: a keep_alive
of 0 from a key that may not unload, as on /api/chat."""

from __future__ import annotations

from lmserve.server.api.embeddings.routes import EmbeddingRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest
from lmserve.server.api.ollama.openapi import OLLAMA_GEN
from lmserve.server.api.route_doc import GEN_ERRORS, Open, RouteDoc


class EmbeddingUsage(Open):
    prompt_tokens: int
    total_tokens: int


class Embedding(Open):
    object: str
    index: int
    embedding: list[float] | str  # str: encoding_format base64 (little-endian float32)


class EmbeddingList(Open):
    object: str
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class OllamaEmbedded(Open):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbedding(Open):
    embedding: list[float]


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("post", "/v1/embeddings"): RouteDoc(EmbeddingRequest, EmbeddingList, GEN_ERRORS),
    ("post", "/api/embed"): RouteDoc(OllamaEmbedRequest, OllamaEmbedded, OLLAMA_GEN),
    ("post", "/api/embeddings"): RouteDoc(OllamaEmbeddingsRequest, OllamaEmbedding, OLLAMA_GEN),
}
ERROR_MODEL = None
