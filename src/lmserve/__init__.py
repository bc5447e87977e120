"""lmserve: an LLM inference server. `from lmserve import LLM, SamplingParams` for offline use (`LLM.embed` with
`PoolingParams`, adapters with `LoRARequest`, `LLM.beam_search` with `BeamSearchParams`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lmserve.config import VERSION  # torch-free; first: it records whether torch was imported before lmserve

# Before anything imports torch: libgomp reads its wait policy once, when torch loads it. Its default
# spins ~3 ms at every barrier, so on a 2-core machine with one busy neighbour a decode step went from
# 25 ms to 1250 ms; sleeping waiters cost about the neighbour's share (benchmarks/results/busy_neighbour.md).
# A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins; a process that imported torch first keeps libgomp's (a CPU
# engine then warns: config.TORCH_FIRST_SPINS).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
# oneDNN (the CPU linear layers) caches a compiled primitive per matmul shape, and PyTorch's ideep layer
# keeps its own per-shape cache; 1024 entries each by default, about 0.5 MB an entry. Prefill chunks come
# in every length, so a server's RSS grew by ~500 MB over its first thousand requests (tests/test_abuse.py's
# soak) before the caches filled. 256 still holds every decode shape (batch sizes x weight shapes) of a
# default server: throughput was unchanged (bench throughput, 1/16/64 sequences), and RSS stays flat.
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, "256")

from lmserve.pooling_params import PoolingParams  # noqa: E402
from lmserve.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402

__version__ = VERSION
__all__ = ["BeamSearchParams", "LLM", "LoRARequest", "PoolingParams", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from lmserve.engine.llm import LLM, LoRARequest


def __getattr__(name: str):
    # LLM pulls in torch and the engine; keep `import lmserve` light for the CLI's --help.
    if name in ("LLM", "LoRARequest"):
        from lmserve.engine import llm
        return getattr(llm, name)
    raise AttributeError(name)
