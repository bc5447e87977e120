"""OpenAI's Responses API (routes.py; its body in input.py, its output items in output.py, stored responses in
store.py); errors in OpenAI's body."""

from lmserve.server.api.dialect import Dialect

DIALECT = Dialect("responses", __name__, generation_paths=("/v1/responses",))
