"""The serve flags -> the server's state (prepare: every check that needs no weights), and loading and unloading one
model's engine. `lmserve serve` (server/start.py) imports this module behind its already-listening port: it pulls in
torch and the engine; a Ray Serve replica (lmserve.deploy) starts from prepare() too."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Callable

from lmserve.errors import ConfigError
from lmserve.ops.hub import build_ops
from lmserve.server.first_checks import FirstChecks, first_checks
from lmserve.server.key_file import KeySpec
from lmserve.server.listen import allowed_entry, check_serve_args
from lmserve.server.media import MediaPolicy
from lmserve.server.metrics import ServerMetrics
from lmserve.server.models.args import keep_alive, model_specs, served_name, traffic_splits  # noqa: F401 - served_name: cli's
from lmserve.server.models.pool import ModelPool, ModelSpec, ServedModel
from lmserve.server.quotas import StorageQuota, parse_quota_flags
from lmserve.server.state import ServerConfig, ServerState, launch_engine, start_engine  # noqa: F401 (tests)

log = logging.getLogger("lmserve.server")


def check_default_max_tokens(default: int | None, max_model_len: int) -> None:
    """A default that fills the whole context would turn every request that names no max_tokens into a 400."""
    if default is not None and default >= max_model_len:
        raise ConfigError(f"--default-max-tokens {default} leaves no room for a prompt in the context of "
                          f"{max_model_len} tokens (max_model_len)")


def server_config(args: argparse.Namespace, name: str,
                  keys: tuple[tuple[str, ...], tuple[KeySpec, ...]]) -> ServerConfig:
    """ServerConfig from the serve flags; `keys` is what read_api_keys returned."""
    keys, named = keys
    return ServerConfig(served_model_name=name, api_keys=keys, named_keys=named, cors_allowed_origins=tuple(args.cors_allowed_origins),
                        metrics_public=args.metrics_public,
                        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                        pace_refused_requests=args.pace_refused_requests,
                        max_rerank_documents=args.max_rerank_documents,
                        max_upload_bytes=args.max_upload_bytes,
                        drain_timeout=args.drain_timeout, default_max_tokens=args.default_max_tokens,
                        max_tokens_limit=args.max_tokens_limit, request_read_timeout=args.request_read_timeout,
                        engine_step_timeout=args.engine_step_timeout or None,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                        lora_dirs=tuple(str(Path(d).resolve()) for d in args.lora_dir),
                        strict_fields=args.strict_fields, reasoning_parser=args.reasoning_parser,
                        tool_call_parser=args.tool_call_parser, storage_quota=_storage_quota(args),
                        media=media_policy(args))


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """--allowed-media-domains (repeatable, comma-separated; compared in lower case, without a trailing dot; an entry
    with :port allows that port, one without it the scheme's default port) and --max-image-bytes."""
    hosts = (h.strip() for flag in args.allowed_media_domains for h in flag.split(","))
    try:
        allowed = tuple(allowed_entry(h) for h in hosts if h)
    except ValueError as e:  # serve checked them already (check_serve_args); run-batch reads them here
        raise ConfigError(f"--allowed-media-domains: {e}") from None
    return MediaPolicy(allowed_domains=allowed, max_image_bytes=args.max_image_bytes)


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
    from lmserve.server.api.responses.store import ResponseStore, default_db_path

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


def prepare(args: argparse.Namespace, first: FirstChecks | None = None) -> ServerState:
    """The server's state (its models configured, none loaded yet) from the serve flags.

    Everything that can be checked without weights is checked here: a bad flag or model raises
    ConfigError / CheckpointError. `serve` and each Ray Serve replica (lmserve.deploy) start from it.
    `first`: what first_checks(args) gave, when the caller ran them already (`serve`, before importing torch).
    """
    check_serve_args(args)
    keys, models = first if first is not None else first_checks(args)
    specs = model_specs(models)
    for spec in specs:
        check_default_max_tokens(args.default_max_tokens, spec.max_model_len)
    names = [s.name for s in specs]
    splits = traffic_splits(args, names)
    config = server_config(args, names[0], keys)
    metrics = ServerMetrics(config.served_model_name)
    metrics.bind_models(names)
    try:
        ops = build_ops(args, metrics.registry, rule_params)
    except (OSError, ValueError) as e:  # a bad rules/reference file or payload-log setting
        raise ConfigError(str(e)) from None
    pool = ModelPool(specs, args.max_loaded_models, args.model_load_timeout, keep_alive(args))
    state = ServerState(config, metrics, ops=ops, response_cache=_response_cache(args, metrics),
                        playground=_playground(args), models=pool, splits=splits)
    _batches(args, state)
    state.responses = _responses(args)
    return state


def rule_params() -> frozenset[str]:
    """The request parameters a validation rule may name (ops/rules.py): every field of the bodies each dialect lists
    (`Dialect.rule_models`: OpenAI's and TGI's) but the prompt, read from their models (a field added there is
    nameable at once)."""
    from lmserve.server.api.dialects import DIALECTS

    models = [m for d in DIALECTS for m in d.rule_models]
    return frozenset(f for m in models for f in m.model_fields) - {"prompt", "messages", "inputs", "parameters"}


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
