"""`lmserve serve`: build the state, load the model in the background, run uvicorn, drain on SIGTERM.

/health answers 503 while the model loads (a failed load ends the process with exit code 1). On
SIGTERM (or SIGINT) new requests get 503, requests in flight get `--drain-timeout` seconds to
finish, the rest are aborted, and the process exits 0. A second signal cuts the drain short.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import uvicorn

from lmserve.config import ENV_API_KEY
from lmserve.errors import CheckpointError, ConfigError
from lmserve.ops.hub import build_ops
from lmserve.server.connections import with_deadline
from lmserve.server.key_file import KeySpec, key_specs, read_key_file
from lmserve.server.metrics import ServerMetrics
from lmserve.server.models.args import keep_alive, model_specs, served_name, traffic_splits  # noqa: F401 - served_name: cli's
from lmserve.server.models.pool import ModelPool, ModelSpec, ServedModel, one_malloc_arena
from lmserve.server.quotas import StorageQuota, parse_quota_flags
from lmserve.server.state import ServerConfig, ServerState, launch_engine, start_engine  # noqa: F401 (tests)

log = logging.getLogger("lmserve.server")


def api_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[KeySpec, ...]]:
    """(plain keys, named keys): --api-key (repeatable), $LMSERVE_API_KEY (comma-separated), and --api-key-file:
    a YAML/JSON file of named keys with limits, or one plain key per line."""
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(ENV_API_KEY, "").split(",") if k.strip()]
    named: list[KeySpec] = []
    if args.api_key_file:
        plain, named = read_key_file(args.api_key_file)
        keys += plain
    key_specs(tuple(keys), tuple(named))  # a name clash between the two is a ConfigError now, not at start
    return tuple(keys), tuple(named)


def check_serve_args(args: argparse.Namespace) -> None:
    """The HTTP-side flags that can never work; ConfigError naming the flag."""
    if not 1 <= args.port <= 65535:  # here, not at bind: a Ray deploy checks these flags once, before any replica
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    for flag, value, low in (("--max-queued-requests", args.max_queued_requests, 0),
                             ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--max-upload-bytes", args.max_upload_bytes, 1),
                             ("--default-max-tokens", args.default_max_tokens, 1),
                             ("--max-tokens-limit", args.max_tokens_limit, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--drain-timeout", args.drain_timeout), ("--engine-step-timeout", args.engine_step_timeout)):
        if not value >= 0:
            raise ConfigError(f"{flag} must be >= 0 seconds, got {value}")
    if not args.request_read_timeout > 0:
        raise ConfigError(f"--request-read-timeout must be > 0 seconds, got {args.request_read_timeout}")
    default, limit = args.default_max_tokens, args.max_tokens_limit
    if default is not None and limit is not None and default > limit:
        raise ConfigError(f"--default-max-tokens {default} is above --max-tokens-limit {limit}")
    if args.allow_runtime_lora_updating and not (args.enable_lora and args.lora_dir):
        raise ConfigError("--allow-runtime-lora-updating needs --enable-lora and at least one --lora-dir")
    for d in args.lora_dir:
        if not Path(d).is_dir():
            raise ConfigError(f"--lora-dir {d}: not a directory")


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a port in use or a host that is not this machine's is a ConfigError before
    the model loads (uvicorn would find out only after it, and exit with a traceback). The port's range was
    checked with the other flags (check_serve_args, from prepare)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} is in use ({host}:{port}: {e.strerror}); stop what holds it or choose "
                              "another with --port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host}: not an address of this machine ({e.strerror})") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def check_default_max_tokens(default: int | None, max_model_len: int) -> None:
    """A default that fills the whole context would turn every request that names no max_tokens into a 400."""
    if default is not None and default >= max_model_len:
        raise ConfigError(f"--default-max-tokens {default} leaves no room for a prompt in the context of "
                          f"{max_model_len} tokens (max_model_len)")


def read_api_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[KeySpec, ...]]:
    """api_keys(), with an unreadable key file as a ConfigError (a malformed one already is one), and none at all
    a ConfigError under --require-api-key."""
    try:
        keys = api_keys(args)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--api-key-file: {e}") from None
    if args.require_api_key and not key_specs(*keys):
        raise ConfigError(f"--require-api-key: no API key was given (--api-key, ${ENV_API_KEY} or a non-empty "
                          "--api-key-file); refusing to serve an open API")
    return keys


def server_config(args: argparse.Namespace, name: str,
                  keys: tuple[tuple[str, ...], tuple[KeySpec, ...]]) -> ServerConfig:
    """ServerConfig from the serve flags; `keys` is what read_api_keys returned."""
    keys, named = keys
    return ServerConfig(served_model_name=name, api_keys=keys, named_keys=named, cors_allowed_origins=tuple(args.cors_allowed_origins),
                        metrics_public=args.metrics_public,
                        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                        max_upload_bytes=args.max_upload_bytes,
                        drain_timeout=args.drain_timeout, default_max_tokens=args.default_max_tokens,
                        max_tokens_limit=args.max_tokens_limit, request_read_timeout=args.request_read_timeout,
                        engine_step_timeout=args.engine_step_timeout or None,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                        lora_dirs=tuple(str(Path(d).resolve()) for d in args.lora_dir),
                        strict_fields=args.strict_fields, reasoning_parser=args.reasoning_parser,
                        tool_call_parser=args.tool_call_parser, storage_quota=_storage_quota(args))


def _storage_quota(args: argparse.Namespace) -> StorageQuota:
    """--storage-quota NAME=VALUE flags over the defaults; a bad one is a ConfigError."""
    try:
        return parse_quota_flags(args.storage_quota)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _response_cache(args: argparse.Namespace, metrics: ServerMetrics):
    """The --response-cache, or None; a bad URL, TTL or size is a ConfigError (a dead Redis is not: it is retried)."""
    if args.response_cache is None:
        return None
    from lmserve.server.response_cache import CacheSettings, ResponseCache

    if not args.response_cache_ttl > 0 or args.response_cache_max_entries < 1:
        raise ConfigError("--response-cache-ttl must be > 0 and --response-cache-max-entries >= 1")
    try:
        return ResponseCache(CacheSettings(args.response_cache, args.response_cache_ttl,
                                           args.response_cache_max_entries), metrics)
    except (ValueError, OSError, ImportError) as e:
        raise ConfigError(f"--response-cache: {e}") from None


def _playground(args: argparse.Namespace):
    """The playground's share store, opened now, or None when off.

    A --playground-db that cannot hold it is a ConfigError; an unwritable default (a read-only home) only
    turns the playground off, with a warning: the API does not need it.
    """
    if args.no_playground:
        return None
    from lmserve.server.playground.store import ShareStore, default_db_path

    return _sqlite_store(ShareStore, "--playground-db", args.playground_db, default_db_path(), "the playground is off")


def _responses(args: argparse.Namespace):
    """The store of /v1/responses answers (store: true), opened now, or None: nothing is stored (as for the
    playground, an unwritable default only warns)."""
    from lmserve.server.api.responses_store import ResponseStore, default_db_path

    return _sqlite_store(ResponseStore, "--responses-db", args.responses_db, default_db_path(),
                         "responses are not stored")


def _sqlite_store(store: Callable[[Path], Any], flag: str, given: str | None, default: Path, off: str):
    """`store` over the SQLite file `flag` names (else `default`), opened now: a given file that cannot hold it is a
    ConfigError; an unusable default logs that the feature is `off` and gives None."""
    import sqlite3

    path = Path(given) if given else default
    try:
        return store(path)
    except (OSError, sqlite3.Error) as e:
        if given:
            raise ConfigError(f"{flag} {path}: {e}") from None
        log.warning("%s: cannot open %s (%s); give %s PATH", off, path, e, flag)
        return None


def _batches(args: argparse.Namespace, state: ServerState) -> None:
    """The batch-job runner over --batch-dir (its directories appear on the first upload)."""
    from lmserve.server.batch.jobs import BatchManager
    from lmserve.server.batch.lines import default_batch_dir
    from lmserve.server.batch.store import BatchStore

    root = Path(args.batch_dir) if args.batch_dir else default_batch_dir()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--batch-dir {str(root)!r} is not a directory")
    if root.exists() and root.stat().st_mode & 0o002:  # anyone could plant or swap a key's files in it
        raise ConfigError(f"--batch-dir {str(root)!r} is writable by every user; give a directory only this user "
                          f"can write")
    state.batches = BatchManager(BatchStore(root), state)


def prepare(args: argparse.Namespace) -> ServerState:
    """The server's state (its models configured, none loaded yet) from the serve flags.

    Everything that can be checked without weights is checked here: a bad flag or model raises
    ConfigError / CheckpointError. `serve` and each Ray Serve replica (lmserve.deploy) start from it.
    """
    check_serve_args(args)
    keys = read_api_keys(args)  # a bad key file fails first, before the engine checks warn about anything
    specs = model_specs(args)
    for spec in specs:
        check_default_max_tokens(args.default_max_tokens, spec.max_model_len)
    names = [s.name for s in specs]
    splits = traffic_splits(args, names)
    config = server_config(args, names[0], keys)
    metrics = ServerMetrics(config.served_model_name)
    metrics.bind_models(names)
    try:
        ops = build_ops(args, metrics.registry)
    except (OSError, ValueError) as e:  # a bad rules/reference file or payload-log setting
        raise ConfigError(str(e)) from None
    pool = ModelPool(specs, args.max_loaded_models, args.model_load_timeout, keep_alive(args))
    state = ServerState(config, metrics, ops=ops, response_cache=_response_cache(args, metrics),
                        playground=_playground(args), models=pool, splits=splits)
    _batches(args, state)
    state.responses = _responses(args)
    return state


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code.

    prepare() and the listening socket check everything they can in the foreground (the CLI prints one line), before
    any model loads.
    """
    one_malloc_arena()  # before a second thread allocates: an unloaded model's memory goes back whole
    state = prepare(args)
    listener = bind_listener(args.host, args.port)
    config, metrics, pool = state.config, state.metrics, state.models
    slow_client = metrics.rejected.labels("read_timeout").inc
    uv_config = uvicorn.Config(None, host=args.host, port=args.port, log_level=args.log_level,  # the app: below
                               timeout_graceful_shutdown=5, access_log=False,  # server/access_log.py writes one
                               ws="none",  # no WebSocket routes: skips importing a websockets stack at start
                               http=with_deadline(config.request_read_timeout, slow_client))
    server = DrainingServer(uv_config, state)
    on_dead = lambda: _exit_on_dead_engine(server)  # noqa: E731
    pool.loader = lambda model: load_engine(state, model.spec, on_dead)
    pool.unloader = lambda model, engine: unload_engine(state, model, engine)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a stop before uvicorn takes the signals over: it exits at once
        signal.signal(sig, server.handle_exit)
    loader = threading.Thread(target=_load, args=(state, server, on_dead), name="lmserve-load", daemon=True)
    loader.start()
    # The routes are imported and built while the first model loads: its GGUF repack and KV allocation run in native
    # code without the GIL, beside these ~0.45 CPU s of imports (issue 32: start to first token). The app serves a
    # loading engine (503 from /health) as it always did.
    from lmserve.server.app import build_app

    uv_config.app = build_app(state, access_log=not args.no_access_log)
    asyncio.run(server.serve(sockets=[listener]))
    engines = pool.engines()
    for engine in engines:
        engine.shutdown()
    state.ops.close()  # after the drain: every finished request's payload line and span is flushed
    for store in (state.playground, state.responses):
        if store is not None:
            store.close()
    engine_died = any(engine.dead is not None for engine in engines)
    code = 0 if server.started and state.load_error is None and not engine_died else 1
    if loader.is_alive():
        _exit_during_load(code)
    return code


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
    from re-raising the signal at exit, so a drained server exits 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._hurry = False  # a second signal: abort what is left now

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None:
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


def _load(state: ServerState, server: uvicorn.Server, on_dead: Callable[[], None]) -> None:
    """Load the first --max-loaded-models models and start their engines (beside the already-listening server,
    so /health says 503 meanwhile); the others load on their first request."""
    pool = state.models
    try:
        for model in list(pool.models.values())[:pool.max_loaded]:
            model.async_engine = load_engine(state, model.spec, on_dead)
    except Exception as e:  # noqa: BLE001 - the log has the details; a server without a model exits
        if isinstance(e, (CheckpointError, ConfigError)):  # a bad weight file, a pool smaller than estimated
            log.error("model load failed: %s", e)  # the message says it all: no traceback
        else:
            log.exception("model load failed")
        state.load_error = f"{type(e).__name__}: {e}"
        server.should_exit = True
        return
    finally:
        # what the start made lives on: kept out of later collections (shorter pauses), and the collector that
        # `lmserve serve` turned off for the start (cli.cmd_serve) is on again
        gc.freeze()
        gc.enable()
    state.started = True
    log.info("serving %s", ", ".join(m.name for m in pool.loaded()))


def load_engine(state: ServerState, spec: ModelSpec, on_dead: Callable[[], None]):
    """Build, warm up and start one model's engine (blocking: a worker thread calls it), its runtime LoRA adapters
    from before an unload registered again; returns its AsyncEngine."""
    log.info("loading model %s", spec.name)
    engine = launch_engine(state, spec.config, on_dead, name=spec.name)
    state.adapter_owners.restore(spec.name, engine.front.loras)
    return engine


def unload_engine(state: ServerState, model: ServedModel, async_engine) -> None:
    """Stop an unloaded model's engine thread and forget its metrics (its memory goes with the last reference);
    its runtime LoRA adapters are kept for its next load."""
    state.adapter_owners.keep(model.name, async_engine.front.loras)
    async_engine.shutdown()
    state.metrics.unbind_engine(model.name)
    log.info("unloaded model %s", model.name)
