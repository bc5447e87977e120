"""Text <-> token ids: the Tokenizer (tokenizer.json or a GGUF's vocabulary) and the sandboxed chat template.

Below the engine: the CLI, the server's front end, LoRA export and benchmarks use it without an engine.
"""

from lmserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
