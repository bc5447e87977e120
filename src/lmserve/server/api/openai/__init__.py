"""OpenAI's completions, chat completions and model list (routes.py); errors in OpenAI's body, the default."""

from lmserve.server.api.dialect import Dialect

DIALECT = Dialect("openai", __name__, generation_paths=("/v1/completions", "/v1/chat/completions"))
