"""`lmserve serve`: build the state, load the model in the background, run uvicorn, drain on SIGTERM.

/health answers 503 while the model loads. On SIGTERM (or SIGINT) new requests get 503, requests
in flight get `--drain-timeout` seconds to finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path

import uvicorn

from lmserve.cli import ENV_API_KEY, engine_config
from lmserve.server.app import build_app
from lmserve.server.metrics import ServerMetrics
from lmserve.server.state import ServerConfig, ServerState

log = logging.getLogger("lmserve.server")


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from --api-key (repeatable), $LMSERVE_API_KEY (comma-separated) and --api-key-file (one per line)."""
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(ENV_API_KEY, "").split(",") if k.strip()]
    if args.api_key_file:
        keys += [line.strip() for line in Path(args.api_key_file).read_text().splitlines() if line.strip()]
    return tuple(keys)


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    from lmserve.loader import resolve_model_path

    path = resolve_model_path(args.model)
    return path.stem.split(".")[0] if path.is_file() else path.name


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code."""
    config = ServerConfig(served_model_name=served_name(args), api_keys=api_keys(args),
                          cors_allowed_origins=tuple(args.cors_allowed_origins),
                          max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                          drain_timeout=args.drain_timeout)
    state = ServerState(config, ServerMetrics(config.served_model_name))
    app = build_app(state)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5, access_log=args.log_level == "debug"))
    return asyncio.run(_run(server, state, args))


async def _run(server: uvicorn.Server, state: ServerState, args: argparse.Namespace) -> int:
    threading.Thread(target=_load, args=(state, args), name="lmserve-load", daemon=True).start()
    serving = asyncio.create_task(server.serve())
    await asyncio.sleep(0)  # let uvicorn install its own handlers first; ours replace them
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(_drain(server, state)))
    await serving
    if state.async_engine is not None:
        state.async_engine.shutdown()
    return 0


def _load(state: ServerState, args: argparse.Namespace) -> None:
    """Load the model and start the engine thread (runs beside the already-listening server)."""
    from lmserve.engine.async_engine import AsyncEngine
    from lmserve.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(engine_config(args))
    except Exception as e:  # noqa: BLE001 - /health reports it; the log has the details
        log.exception("model load failed")
        state.load_error = f"{type(e).__name__}: {e}"
        return
    warmup = _warm_up(engine)
    async_engine = AsyncEngine(engine)
    async_engine.step_listeners.append(state.metrics.on_step)
    state.metrics.bind_engine(engine, warmup)
    async_engine.start()
    state.async_engine = async_engine
    log.info("serving %s", state.config.served_model_name)


def _warm_up(engine) -> float:
    """One tiny request through every code path before the first client; returns its seconds."""
    from lmserve.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request("warm-up", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


async def _drain(server: uvicorn.Server, state: ServerState) -> None:
    """Stop admitting, wait for in-flight requests (up to the drain timeout), abort the rest, exit."""
    if state.draining:
        return
    state.draining = True
    log.info("draining %d request(s) for up to %.0f s", state.in_flight, state.config.drain_timeout)
    deadline = asyncio.get_running_loop().time() + state.config.drain_timeout
    while state.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight and state.async_engine is not None:
        state.metrics.aborts.labels("shutdown").inc(state.in_flight)
        state.async_engine.abort_all()
        await asyncio.sleep(0.5)  # let aborted streams send their last chunks
    server.should_exit = True
