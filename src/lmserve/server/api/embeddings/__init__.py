"""Embeddings (routes.py): OpenAI's /v1/embeddings and Ollama's /api/embed and /api/embeddings (whose errors are
Ollama's, by their /api/ path)."""

from lmserve.server.api.dialect import Dialect

# like generation routes, the Observe middleware keeps a record of each (and settles the key's usage)
DIALECT = Dialect("embeddings", __name__, generation_paths=("/v1/embeddings", "/api/embed", "/api/embeddings"))
