"""The engine as the server sees it: the one module of engine/ that server/ imports (tests/test_layering.py checks).

The server holds one `AsyncEngine` per loaded model (generate, abort, health, shutdown; step and fault listeners)
and reads the model through that engine's `EngineFront`: tokenizer, limits, request checks, grammars, adapters,
and `load()`, the queue and the KV pool now (engine/stats.EngineLoad). The scheduler, the KV pool and the runner
stay behind these. `open_engine` builds a model's engine and warms it up (fitting its step budget to the host);
`serve_engine` puts a built engine behind its AsyncEngine, not yet started.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from lmserve.config import EngineConfig
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.faults import install_from_env
from lmserve.engine.front import EngineFront
from lmserve.engine.llm_engine import LLMEngine
from lmserve.engine.step_budget import fit_step_budget
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineFront", "LLMEngine", "Opened", "open_engine", "serve_engine", "warm_up"]


class Opened(NamedTuple):
    """A model's engine, built and warmed up, not yet serving."""

    engine: LLMEngine
    warmup_seconds: float


def open_engine(config: EngineConfig) -> Opened:
    """Build the engine `config` names and warm it up (blocking: a worker thread or the offline runner calls it)."""
    engine = LLMEngine(config)
    return Opened(engine, warm_up(engine))


def serve_engine(engine: LLMEngine, step_timeout: float | None) -> AsyncEngine:
    """`engine` behind its AsyncEngine (its thread not started); `step_timeout`: the hung-step watchdog (None: off)."""
    install_from_env(engine)  # test-only fault injection, after warm-up: nothing unless $LMSERVE_TEST_FAULT is set
    return AsyncEngine(engine, step_timeout=step_timeout)


def warm_up(engine: LLMEngine) -> float:
    """One tiny request through every code path before the first client, then the step budget fitted to this host
    (engine/step_budget.py); returns its seconds."""
    start = time.perf_counter()
    # an encoder pools its prompt (it never generates)
    pooling = PoolingParams() if engine.model_config.encoder else None
    engine.add_request("warm-up", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0, pooling=pooling))
    while engine.has_unfinished():
        engine.step()
    fit_step_budget(engine)
    return time.perf_counter() - start
