"""`lmserve serve`: listen first, then import, check and load behind the open port; drain on SIGTERM.

The order, and why: the HTTP-side flags are checked and the port bound at once (a port in use is still one line and
exit 2 before anything loads), and uvicorn serves a StartGate (server/gate.py) ~0.3 s after the process starts. This
module imports nothing of torch or the engine: the load thread runs the checks that need neither
(server/first_checks.py: the key file, each model's path and header file), then imports them (`import torch` is 1-4 s
of a start), prepare()s the state (every other flag, what the model's header says, the KV pool's size), opens the
real app behind the gate and loads the first models. Meanwhile /health answers 503 `loading`, and a request waits for
the model (up to --model-load-timeout) instead of being refused.

A flag or model that prepare() refuses ends the process as before, one `lmserve: error:` line and exit 2: uvicorn's
start-up lines are held until the app opens, and dropped if it never does. A load that fails ends it with exit code
1 (/health answers 503 `failed` meanwhile). On SIGTERM (or SIGINT) new requests get 503, requests in flight get
`--drain-timeout` seconds to finish, the rest are aborted, and the process exits 0; a second signal cuts the drain
short; a signal during the load exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import uvicorn

from lmserve.errors import CheckpointError, ConfigError
from lmserve.server.connections import with_deadline
from lmserve.server.gate import StartGate
from lmserve.server.listen import bind_listener, check_serve_args
from lmserve.server.models.pool import one_malloc_arena

log = logging.getLogger("lmserve.server")


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code (a refused flag or model: ConfigError or
    CheckpointError, raised here as before the port opened)."""
    one_malloc_arena()  # before a second thread allocates: an unloaded model's memory goes back whole
    check_serve_args(args)
    listener = bind_listener(args.host, args.port)
    gate = StartGate(args.model_load_timeout)
    start = Start(gate)
    uv_config = uvicorn.Config(gate, host=args.host, port=args.port, log_level=args.log_level,
                               timeout_graceful_shutdown=5, access_log=False,  # server/access_log.py writes one
                               # uvicorn's 5 s equals httpx's pool expiry: a client reusing a connection at 4.99 s
                               # met the server closing it ("Server disconnected without sending a response")
                               timeout_keep_alive=args.timeout_keep_alive,
                               ws="none",  # no WebSocket routes: skips importing a websockets stack at start
                               http=with_deadline(args.request_read_timeout, start.slow_client))
    held = HeldLogs(logging.getLogger("uvicorn.error"))
    server = start.server = DrainingServer(uv_config)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a stop before uvicorn takes the signals over: it exits at once
        signal.signal(sig, server.handle_exit)
    loader = threading.Thread(target=start.run, args=(args, held), name="lmserve-load", daemon=True)
    loader.start()
    asyncio.run(server.serve(sockets=[listener]))
    code = start.finish(server)
    if loader.is_alive():
        _exit_during_load(code)
    if start.refused is not None:
        raise start.refused
    return code


class Start:
    """The load thread's work and what it leaves for the exit: the state, a refused flag, the load's failure."""

    def __init__(self, gate: StartGate) -> None:
        self.gate = gate
        self.server: DrainingServer | None = None
        self.state: Any = None  # the ServerState, once prepare() made it
        self.refused: ConfigError | CheckpointError | None = None  # prepare() said no: the CLI's one line, exit 2
        self.crashed = False  # the start itself raised (a bug): exit 1

    def slow_client(self) -> None:
        """A connection closed for reading too slowly: counted once the metrics exist."""
        if self.state is not None:
            self.state.metrics.rejected.labels("read_timeout").inc()

    def run(self, args: argparse.Namespace, held: HeldLogs) -> None:
        """The load thread: import the engine and the routes, prepare the state, open the app, load the models."""
        try:
            # here, not at the top: the GGUF header's reader imports numpy, kept out of the time to listen
            from lmserve.server.first_checks import first_checks

            first = first_checks(args)  # before torch: a mistake here is refused at once
            from lmserve.server.app import build_app  # torch, the engine and every route: here, behind the port
            from lmserve.server.main import load_engine, prepare, unload_engine

            state = prepare(args, first)
            app = build_app(state, access_log=not args.no_access_log)
        except (ConfigError, CheckpointError) as e:
            self.refused = e
            return self._stop(held)
        except Exception:  # noqa: BLE001 - a bug, not a flag: the traceback goes to the log, exit 1
            log.exception("the server could not start")
            self.crashed = True
            return self._stop(held)
        state.starting = True  # before the app opens: its requests wait for the load below
        self.state = self.server.state = state
        on_dead = lambda: _exit_on_dead_engine(self.server)  # noqa: E731
        state.models.loader = lambda model: load_engine(state, model.spec, on_dead)
        state.models.unloader = lambda model, engine: unload_engine(state, model, engine)
        if not self._open(app):
            return
        held.release()
        _load(state, self.server, on_dead, load_engine)

    def _open(self, app) -> bool:
        """Hand the app to the gate on uvicorn's loop (once it runs); False if the server stops first."""
        while self.gate.loop is None:
            if self.server.should_exit:
                return False
            time.sleep(0.01)
        count = lambda status: self.state.metrics.status(status, not_ready=True)  # noqa: E731 - as the app counts them
        asyncio.run_coroutine_threadsafe(self.gate.open(app, count), self.gate.loop).result()
        return True

    def _stop(self, held: HeldLogs) -> None:
        held.drop()
        self.gate.fail()
        self.server.should_exit = True

    def finish(self, server: DrainingServer) -> int:
        """After uvicorn: stop the engines, flush and close the stores; the exit code."""
        state = self.state
        if state is None:  # stopped before prepare() was done: by a signal (0), or the start failed
            return 1 if self.crashed or self.refused is not None else 0
        engines = state.models.engines()
        for engine in engines:
            engine.shutdown()
        state.ops.close()  # after the drain: every finished request's payload line and span is flushed
        for store in (state.playground, state.responses):
            if store is not None:
                store.close()
        engine_died = any(engine.dead is not None for engine in engines)
        return 0 if server.started and state.load_error is None and not engine_died else 1


class HeldLogs(logging.Filter):
    """uvicorn's start-up lines ("Started server process", "Uvicorn running on ...") held until the app opens, and
    dropped if the start is refused: a bad flag stays the one `lmserve: error:` line it was when the checks ran
    before uvicorn started (tests/test_cli_errors.py)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self.mode, self.held = logger, "hold", []
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.mode == "hold":
            self.held.append(record)
        return self.mode == "pass"

    def release(self) -> None:
        self.mode = "pass"
        held, self.held = self.held, []
        for record in held:
            self.logger.handle(record)

    def drop(self) -> None:
        self.mode, self.held = "drop", []


def _load(state, server: uvicorn.Server, on_dead: Callable[[], None], load_engine: Callable) -> None:
    """Load the first --max-loaded-models models and start their engines (the app already serves: /health says 503
    meanwhile, requests wait); the others load on their first request."""
    pool = state.models
    try:
        for model in list(pool.models.values())[:pool.max_loaded]:
            model.async_engine = load_engine(state, model.spec, on_dead)
    except Exception as e:  # noqa: BLE001 - the log has the details; a server without a model exits
        if isinstance(e, (CheckpointError, ConfigError)):  # a bad weight file, a pool smaller than estimated
            log.error("model load failed: %s", e)  # the message says it all: no traceback
        else:
            log.exception("model load failed")
        state.load_error, state.starting = f"{type(e).__name__}: {e}", False
        server.should_exit = True
        return
    finally:
        # what the start made lives on: kept out of later collections (shorter pauses), and the collector that
        # `lmserve serve` turned off for the start (cli.cmd_serve) is on again
        gc.freeze()
        gc.enable()
    state.started, state.starting = True, False  # in this order: a waiting request never sees neither
    log.info("serving %s", ", ".join(m.name for m in pool.loaded()))


def _exit_during_load(code: int) -> None:
    """A signal came while the model was loading: leave now, without the interpreter's teardown.

    The load thread is inside torch; a normal exit would run C++ static destructors beneath it, and libstdc++
    aborts ("terminate called without an active exception", exit code 134). Nothing is left to flush but logs;
    a compile of the native kernels the load started (its compiler processes) is stopped with it.
    """
    import psutil

    log.info("stopped while the model was loading")
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_on_dead_engine(server: uvicorn.Server) -> None:
    """A dead engine never serves again: exit (code 1) so the supervisor restarts the process.

    /health already answers 503 (AsyncEngine.alive is false); in-flight requests have their 500/503
    and get uvicorn's graceful-shutdown seconds to send it.
    """
    log.critical("the engine has failed for good; exiting with code 1 so a supervisor restarts the server")
    server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM/SIGINT drain in-flight requests before it exits.

    uvicorn installs handle_exit as a plain Python signal handler; overriding it also keeps uvicorn
    from re-raising the signal at exit, so a drained server exits 0. Until the state exists (the start's
    imports and checks) a signal only stops the server.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.state = None  # the ServerState, set by the load thread once prepared
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._hurry = False  # a second signal: abort what is left now

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None or self.state is None:
            self.should_exit = True
        elif self._drain_task is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self._hurry = True

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Stop admitting, wait for in-flight requests (up to the drain timeout), abort the rest, exit."""
        st, loop = self.state, asyncio.get_running_loop()
        st.draining = True
        if st.batches is not None:  # a running batch job stops here and resumes after the restart
            st.batches.stop()
        log.info("draining %d request(s) for up to %.0f s", st.in_flight, st.config.drain_timeout)
        deadline = loop.time() + st.config.drain_timeout
        while st.in_flight and loop.time() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        engines = st.models.engines()
        if st.in_flight and engines:
            loads = [e.front.load() for e in engines]
            running, waiting = sum(x.num_running for x in loads), sum(x.num_waiting for x in loads)
            log.warning("drain: aborting %d request(s) still in flight (running %d, waiting %d)", st.in_flight,
                        running, waiting)
            st.metrics.aborts.labels("shutdown").inc(st.in_flight)
            for engine in engines:
                engine.abort_all()
            await asyncio.sleep(0.5)  # let aborted streams send their last chunks
        self.should_exit = True  # uvicorn then gives open responses timeout_graceful_shutdown to end
