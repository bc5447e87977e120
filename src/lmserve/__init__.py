"""lmserve: an LLM inference server. `from lmserve import LLM, SamplingParams` for offline use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from lmserve.engine.llm import LLM


def __getattr__(name: str):
    # LLM pulls in torch and the engine; keep `import lmserve` light for the CLI's --help.
    if name == "LLM":
        from lmserve.engine.llm import LLM
        return LLM
    raise AttributeError(name)
