"""The server's own settings (the engine has its own EngineConfig): limits, timeouts, keys and switches."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.server.errors import APIError
from lmserve.server.key_file import KeySpec
from lmserve.server.media import MediaPolicy
from lmserve.server.quotas import StorageQuota


@dataclass(frozen=True)
class TokenLimits:
    """The operator's --default-max-tokens and --max-tokens-limit (None: the API's own meaning)."""

    default: int | None = None  # for a request that names no max_tokens
    limit: int | None = None  # more is a 400; a request naming none is held to it too

    def resolve(self, named: int | None, api_default: int | None, param: str) -> int | None:
        """The max_tokens a request runs with; `named` is what it asked for (None: nothing)."""
        if named is not None:
            if self.limit is not None and named > self.limit:
                raise APIError(400, f"{param} must be at most {self.limit} on this server, got {named}", param=param)
            return named
        value = self.default if self.default is not None else api_default
        if self.limit is not None:  # None (chat: the rest of the context) would pass the limit by
            value = self.limit if value is None else min(value, self.limit)
        return value


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings (the engine has its own EngineConfig)."""

    served_model_name: str
    api_keys: tuple[str, ...] = ()  # plain keys: unlimited, all models, named "default"
    named_keys: tuple[KeySpec, ...] = ()  # from a YAML/JSON --api-key-file: names and limits
    cors_allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all (browsers refuse cross-origin calls)
    metrics_public: bool = False  # /metrics without an API key (a scraper on a trusted network)
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 2**20
    pace_refused_requests: float = 10.0  # refusals a second a key may have while others are served (server/pacing.py)
    max_rerank_documents: int = 1000  # documents (text pairs) in one rerank or score request
    max_upload_bytes: int = 64 * 2**20  # POST /v1/files (a batch job's input file), held in memory while it arrives
    drain_timeout: float = 30.0
    default_max_tokens: int | None = None  # a request naming no max_tokens gets this (None: the API's own default)
    max_tokens_limit: int | None = None  # more is a 400; a request naming none is held to it too
    request_read_timeout: float = 30.0  # seconds from a request's first byte to its last (slow-loris clients)
    engine_step_timeout: float | None = 300.0  # the hung-engine watchdog; None: off
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_dirs: tuple[str, ...] = ()  # the only directories those routes may read adapters from
    strict_fields: bool = False  # an unknown request field is a 400 (else ignored, logged, named in X-Ignored-Fields)
    reasoning_parser: str | None = None  # --reasoning-parser: qwen3 | deepseek_r1 (None: replies are not split)
    tool_call_parser: str | None = None  # --tool-call-parser (None: each model's chat template's family)
    storage_quota: StorageQuota = StorageQuota()  # --storage-quota: what each key may store (a key file entry's wins)
    media: MediaPolicy = MediaPolicy()  # --allowed-media-domains, --max-image-bytes: where images may come from

    @property
    def token_limits(self) -> TokenLimits:
        return TokenLimits(self.default_max_tokens, self.max_tokens_limit)
