"""vLLM's dynamic LoRA adapter routes (routes.py; the bodies in server/protocol.py); errors in OpenAI's body."""

from lmserve.server.api.dialect import Dialect

DIALECT = Dialect("lora", __name__)
