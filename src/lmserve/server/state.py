"""ServerState: what routes share (the engine handle, names, limits, metrics, lifecycle flags) and their prologue."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine, RequestRejected
from lmserve.ops.hub import Ops
from lmserve.ops.record import RequestRecord
from lmserve.lora.peft_adapter import AdapterError
from lmserve.request import CompletionDelta, LoraRequest
from lmserve.sampling_params import SamplingParams
from lmserve.server.errors import APIError
from lmserve.server.metrics import ServerMetrics
from lmserve.server.params import TokenLimits
from lmserve.server.protocol import parse_body, parse_data
from lmserve.server.tenants import ANONYMOUS, KeySpec, Tenants, key_specs

T = TypeVar("T")


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
    max_upload_bytes: int = 64 * 2**20  # POST /v1/files (a batch job's input file), held in memory while it arrives
    drain_timeout: float = 30.0
    default_max_tokens: int | None = None  # a request naming no max_tokens gets this (None: the API's own default)
    max_tokens_limit: int | None = None  # more is a 400; a request naming none is held to it too
    request_read_timeout: float = 30.0  # seconds from a request's first byte to its last (slow-loris clients)
    engine_step_timeout: float | None = 300.0  # the hung-engine watchdog; None: off
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_dirs: tuple[str, ...] = ()  # the only directories those routes may read adapters from

    @property
    def token_limits(self) -> TokenLimits:
        return TokenLimits(self.default_max_tokens, self.max_tokens_limit)


@dataclass
class ServerState:
    """Mutable per-process state; `engine` is None while the model loads."""

    config: ServerConfig
    metrics: ServerMetrics
    async_engine: AsyncEngine | None = None
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0
    ops: Ops = field(default_factory=Ops)  # tracing, payload log, rules, drift (each off unless configured)
    created: int = field(default_factory=lambda: int(time.time()))
    tenants: Tenants = field(init=False)  # accepted keys, per-key limits and usage
    response_cache: Any = None  # server/response_cache.ResponseCache with --response-cache, else None
    playground: Any = None  # server/playground/store.ShareStore; None: the playground is off (--no-playground)
    batches: Any = None  # server/batch_jobs.BatchManager (serve always has one); None: /v1/batches answers 404

    def __post_init__(self) -> None:
        self.tenants = Tenants(key_specs(self.config.api_keys, self.config.named_keys), self.metrics)

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine

    @property
    def ready(self) -> bool:
        return self.async_engine is not None and self.async_engine.alive and not self.draining

    @property
    def not_ready(self) -> bool:
        """Loading or draining: a 503 now is the expected answer, not a fault (a dead engine is one)."""
        return self.draining or (self.async_engine is None and not self.load_error)

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"}, reason="not_ready")
        if self.async_engine is None:
            raise APIError(503, "the model is still loading", headers={"Retry-After": "5"}, reason="not_ready")
        if not self.async_engine.alive:
            raise APIError(503, "the engine has stopped", headers={"Retry-After": "30"}, reason="not_ready")

    def check_model(self, name: str | None) -> None:
        """404 unless `name` is None, the base model's name or a registered adapter's."""
        resolve_adapter(self, name)

    async def lora_for(self, name: str | None) -> LoraRequest | None:
        """The request's adapter, read from disk off the event loop unless cached; None for the base model."""
        adapter = resolve_adapter(self, name)
        if adapter is None:
            return None
        try:
            lora = await asyncio.to_thread(self.engine.loras.get, adapter)
        except AdapterError as e:  # its directory changed on disk since it was registered
            raise APIError(400, str(e), param="model") from None
        if lora is None:  # unloaded between the check and the read
            raise _unknown_model(self, name)
        return lora

    def admit(self, prompts: list[list[int]], params: SamplingParams, record: RequestRecord) -> list[int]:
        """Validate against the engine and the queue limit before anything reaches the engine thread.

        Returns each prompt's resolved max_tokens for generate: this is the only check_request of the request.

        Queue rule: each prompt of a request is one engine request (its n completions included), and
        engine requests count from admission until their stream ends. A request is refused with 503 +
        Retry-After when in-flight engine requests plus its own prompts would exceed
        max_num_seqs + max_queued_requests (the running batch plus the queue we accept to hold).
        """
        max_tokens = [self._check(ids, params) for ids in prompts]
        record.prompt_tokens = sum(len(ids) for ids in prompts)
        self.check_rules(record, [len(ids) for ids in prompts])
        limit = self.engine.cfg.scheduler.max_num_seqs + self.config.max_queued_requests
        if self.in_flight + len(prompts) > limit:
            raise APIError(503, f"the server is at capacity ({limit} requests in flight); retry shortly",
                           headers={"Retry-After": "1"}, reason="queue_full")
        # The key's limits come last, so a request refused for any other reason costs the key nothing.
        self.tenants.admit(record, record.prompt_tokens + params.n * sum(max_tokens))
        return max_tokens

    def _check(self, ids: list[int], params: SamplingParams) -> int:
        """engine.check_request as an HTTP 400; returns the prompt's resolved max_tokens."""
        try:
            return self.engine.check_request(ids, params)
        except RequestRejected as e:
            reason = "context_length" if e.param == "prompt" else "invalid_request"
            raise APIError(400, str(e), param=e.param, reason=reason) from None

    def check_rules(self, record: RequestRecord, prompt_token_counts: list[int]) -> None:
        """The operator's validation rules (--validation-rules); a `reject` rule answers 400."""
        if self.ops.rules is None:
            return
        from lmserve.ops.rules import RuleViolation

        try:
            self.ops.check(record, prompt_token_counts)
        except RuleViolation as e:
            raise APIError(400, str(e), param=e.param, code="rule_violation", reason="validation_rule") from None

    async def compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled grammar (None when unconstrained), compiled off the event loop and the engine thread.

        Bounded by the engine's StructuredOutputsConfig: an invalid or too costly spec is a 400 naming it.
        """
        so = params.structured_outputs
        if so is None:
            return None
        self.metrics.structured_requests.labels(so.kind).inc()
        try:
            compiled = await asyncio.to_thread(self.engine.compile_grammar, params)
        except RequestRejected as e:
            raise APIError(400, str(e), param="structured_outputs", reason="invalid_request") from None
        self.metrics.grammar_compile.labels("hit" if compiled.cached else "miss").observe(compiled.seconds)
        return compiled

    def generate(self, request_id: str, ids: list[int], params: SamplingParams, max_tokens: int,
                 record: RequestRecord, first_output: int = 0, grammar: Any = None,
                 priority: int = 0, lora: LoraRequest | None = None) -> AsyncIterator[CompletionDelta]:
        """An engine stream that counts toward the in-flight limit until it ends.

        `max_tokens` is what admit returned for these ids; `grammar` what compile_grammar returned. Its completions fill
        record.outputs[first_output + index] (several prompts share one record). `priority`: see Request.priority.
        `lora`: what lora_for returned (None: the base model).
        """
        if record.engine_arrival is None:
            record.engine_arrival = time.monotonic()
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        inner = self.async_engine.generate(request_id, ids, params, max_tokens, grammar, tenant=record.key_name or "",
                                          priority=priority, lora=lora)

        async def counted():
            started, first, last = time.monotonic(), {}, {}  # per completion index
            try:
                async for d in inner:
                    self._observe(d, started, first, last)
                    _record_delta(record, first_output, d)
                    yield d
            finally:
                await inner.aclose()
                self.in_flight -= 1
                self.metrics.in_flight.set(self.in_flight)

        return counted()

    def _observe(self, d: CompletionDelta, started: float, first: dict, last: dict) -> None:
        """TTFT and inter-token gaps as the client sees them; per-completion totals when one finishes."""
        now = time.monotonic()
        m = self.metrics
        if d.token_ids:
            if d.index not in first:
                first[d.index] = now
                m.ttft.observe(now - started)
            else:
                m.itl.observe((now - last[d.index]) / len(d.token_ids))
            last[d.index] = now
        if d.finished:
            m.prompt_tokens.inc(d.num_prompt_tokens if d.index == 0 else 0)
            m.generation_tokens.inc(d.num_output_tokens)
            m.on_finished(d, started, first.get(d.index), now)

    async def tokenize(self, prompt: str | list[int], record: RequestRecord) -> list[int]:
        """Tokenize a raw prompt (special tokens parsed) or check ids, off the event loop (long prompts stall it)."""
        start = time.monotonic()
        try:
            return await asyncio.to_thread(self.engine.tokenize_prompt, prompt)
        except RequestRejected as e:
            raise APIError(400, str(e), param="prompt") from None
        finally:
            record.tokenize_s += time.monotonic() - start

    async def tokenize_chat(self, messages: list[dict], record: RequestRecord,
                            template_kwargs: dict | None = None) -> list[int]:
        """Render the chat template (with extra variables such as `tools`) and tokenize, off the event loop."""
        start = time.monotonic()
        try:
            return await asyncio.to_thread(self.engine.tokenizer.encode_chat, messages, True, **(template_kwargs or {}))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        finally:
            record.tokenize_s += time.monotonic() - start


def _record_delta(record: RequestRecord, first_output: int, d: CompletionDelta) -> None:
    """What the client got, for the payload log, tracing and drift."""
    out = record.output(first_output + d.index)
    out.text += d.text
    if d.token_ids and record.ttft_s is None:
        record.ttft_s = time.monotonic() - record.start
    if d.finished:
        out.tokens, out.finish_reason = d.num_output_tokens, d.finish_reason
        out.cumulative_logprob = d.cumulative_logprob
        if d.timings is not None:  # the slowest completion of the request sets its phases
            t = d.timings
            record.queue_s, record.prefill_s = max(record.queue_s, t.queue_s), max(record.prefill_s, t.prefill_s)
            record.decode_s, record.detokenize_s = max(record.decode_s, t.decode_s), max(record.detokenize_s,
                                                                                         t.detokenize_s)
            record.num_preemptions += t.num_preemptions


def resolve_adapter(st: ServerState, name: str | None) -> str | None:
    """A request's model name -> the LoRA adapter it picks (None: the base model); anything else is a 404.

    The one place a model name is resolved (several base models per server will extend it).
    """
    if name is None or name == st.config.served_model_name:
        return None
    loras = st.engine.loras if st.async_engine is not None else None
    if loras is not None and loras.lookup(name) is not None:
        return name
    raise _unknown_model(st, name)


def _unknown_model(st: ServerState, name: str) -> APIError:
    return APIError(404, f"model {name[:80]!r} does not exist (this server serves "
                    f"{st.config.served_model_name!r})", param="model", code="model_not_found")


def state_of(request: Request) -> ServerState:
    return request.app.state.lm


RECORD_KEY = "lmserve_record"  # where the Observe middleware puts the request's record in scope["state"]
KEY_NAME_KEY = "lmserve_key_name"  # where the auth middleware puts the API key's name
_PROMPT_FIELDS = ("prompt", "inputs", "messages")


def record_of(request: Request) -> RequestRecord:
    """The request's record, opened by the Observe middleware (a detached one for routes it does not watch)."""
    record = request.scope.get("state", {}).get(RECORD_KEY)
    return record if record is not None else RequestRecord("", request.url.path)


def key_name_of(request: Request) -> str:
    """The name of the request's API key (set by the auth middleware); "anonymous" on a server without keys."""
    return request.scope.get("state", {}).get(KEY_NAME_KEY, ANONYMOUS)


async def read_request(request: Request, model: type[T]) -> tuple[ServerState, T]:
    """Every API route's prologue: the engine is ready, the body parses strictly, the model is ours and the key's."""
    st = state_of(request)
    st.check_ready()
    req = parse_body(await request.body(), model)
    accept(st, req, record_of(request), key_name_of(request))
    return st, req


def read_data(st: ServerState, data: Any, model: type[T], record: RequestRecord) -> T:
    """read_request for a body already parsed from JSON (a batch job's line); record.key_name is whose job it is."""
    st.check_ready()
    req = parse_data(data, model)
    accept(st, req, record, record.key_name or ANONYMOUS)
    return req


def accept(st: ServerState, req: BaseModel, record: RequestRecord, key_name: str) -> None:
    """The body names our model and one the key may use; its parameters go into the record."""
    _describe(record, req, st.config.served_model_name)
    st.check_model(getattr(req, "model", None))
    st.tenants.check_model(key_name, st.config.served_model_name)


def _describe(record: RequestRecord, req: BaseModel, served_name: str) -> None:
    """Copy what the client asked for into the record: parameters (TGI's flattened), prompt or messages."""
    body = req.model_dump(exclude_unset=True, mode="json")
    record.model = served_name
    record.prompt = body.get("prompt", body.get("inputs"))
    record.messages = body.get("messages")
    params = {k: v for k, v in body.items() if k not in _PROMPT_FIELDS}
    params.update(params.pop("parameters", None) or {})
    record.params = params
    record.stream = bool(params.get("stream", False))
