"""ServerState: what routes share (the engine handle, names, limits, metrics, lifecycle flags) and their prologue."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from lmserve.config import EngineConfig
from lmserve.engine.serving import AsyncEngine, EngineFront, LLMEngine, open_engine, serve_engine
from lmserve.ops.hub import Ops
from lmserve.ops.record import RequestRecord
from lmserve.server.adapter_owners import AdapterOwners
from lmserve.server.config import ServerConfig
from lmserve.server.connections import ARRIVED_KEY
from lmserve.server.errors import APIError
from lmserve.server.key_file import ANONYMOUS, key_specs
from lmserve.server.metrics import ServerMetrics
from lmserve.server.models.pool import ModelLoadError, ModelPool, ModelSpec, ServedModel
from lmserve.server.models.traffic import TrafficSplit
from lmserve.server.pacing import RefusalPacer
from lmserve.server.protocol import parse_body, parse_data
from lmserve.server.quotas import StorageQuota
from lmserve.server.response_cache import ResponseCache
from lmserve.server.served import ModelState
from lmserve.server.tenants import Tenants

T = TypeVar("T")
START_POLL_S = 0.01  # how often a request waiting for the start-up load looks (ServerState.wait_ready)
log = logging.getLogger("lmserve.server")


class Shares(Protocol):
    """The playground's share store (server/playground/store.ShareStore) as the middle uses it: closed at exit.

    Typed by what the middle calls because the playground sits above the middle and imports it."""

    def close(self) -> None: ...


class StoredResponses(Protocol):
    """The Responses API's store (server/api/responses/store.ResponseStore) as the middle uses it: closed at exit.
    Typed so because the API modules sit above the middle."""

    def close(self) -> None: ...


class BatchRunner(Protocol):
    """The batch jobs' runner (server/batch/jobs.BatchManager) as the middle uses it: started with the app,
    stopped at its end or when a drain begins. Typed so because the batch jobs sit above the middle."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class ServerState:
    """Mutable per-process state shared by every model; a request's own model is a served.ModelState."""

    config: ServerConfig
    metrics: ServerMetrics
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0
    ops: Ops = field(default_factory=Ops)  # tracing, payload log, rules, drift (each off unless configured)
    created: int = field(default_factory=lambda: int(time.time()))
    tenants: Tenants = field(init=False)  # accepted keys, per-key limits and usage
    pacer: RefusalPacer = field(init=False)  # keys whose requests keep being refused wait while others are served
    adapter_owners: AdapterOwners = field(default_factory=AdapterOwners)  # who loaded which runtime adapter
    response_cache: ResponseCache | None = None  # with --response-cache
    playground: Shares | None = None  # a playground/store.ShareStore; None: the playground is off (--no-playground)
    batches: BatchRunner | None = None  # a batch/jobs.BatchManager (serve has one); None: /v1/batches answers 404
    responses: StoredResponses | None = None  # an api/responses/store.ResponseStore; None: nothing is stored
    models: ModelPool | None = None  # None: one model named config.served_model_name, started by the caller
    splits: dict[str, TrafficSplit] = field(default_factory=dict)  # --route NAME=MODEL:WEIGHT,...
    started: bool = False  # the start-up loads are done: the server serves from here on
    starting: bool = False  # `serve`'s start-up loads are running (server/start.py): requests wait for them
    _rng: random.Random = field(default_factory=random.Random, repr=False)  # splits of requests without a user

    def __post_init__(self) -> None:
        self.tenants = Tenants(key_specs(self.config.api_keys, self.config.named_keys), self.metrics)
        rate = self.config.pace_refused_requests
        self.pacer = RefusalPacer(rate, 2 * rate)
        if self.models is None:  # one model whose engine the caller starts (start_engine): tests, run-batch
            self.models = ModelPool([ModelSpec(self.config.served_model_name)])

    @property
    def async_engine(self) -> AsyncEngine | None:
        """The default model's engine (None while it loads, or once unloaded)."""
        return self.models.default.async_engine

    @async_engine.setter
    def async_engine(self, engine: AsyncEngine | None) -> None:
        self.models.default.async_engine = engine
        self.started = self.started or engine is not None

    @property
    def front(self) -> EngineFront:
        """The default model's front end (its tokenizer, limits, checks)."""
        return self.async_engine.front

    @property
    def dead(self) -> bool:
        """A loaded engine has failed for good (the process is on its way out)."""
        return any(not e.alive for e in self.models.engines())

    @property
    def ready(self) -> bool:
        return self.started and not self.dead and not self.draining

    @property
    def not_ready(self) -> bool:
        """Loading or draining: a 503 now is the expected answer, not a fault (a dead engine is one)."""
        return self.draining or (not self.started and not self.load_error)

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"}, reason="not_ready")
        if self.load_error is not None:
            raise APIError(503, "the model failed to load; the server is stopping", headers={"Retry-After": "30"})
        if not self.started:
            raise APIError(503, "the model is still loading; retry shortly",
                           headers={"Retry-After": "5"}, reason="not_ready")
        if self.dead:
            raise APIError(503, "the engine has stopped", headers={"Retry-After": "30"}, reason="not_ready")

    async def wait_ready(self, arrived: float | None = None) -> None:
        """check_ready(), after waiting out the start-up load: a request sent as the server starts is answered once
        its model is up, not refused. The wait ends at the load, a failed load or a drain, or --model-load-timeout
        after the request `arrived` (monotonic; the StartGate's stamp, else now); then check_ready says why not.
        Only while `starting`: a state whose engine its owner starts (tests, a Ray replica) answers 503 at once.

        Polled: the load thread sets `started`, and a 10 ms poll costs nothing beside a load of a second or more."""
        deadline = (time.monotonic() if arrived is None else arrived) + self.models.load_timeout
        while self.starting and not (self.started or self.load_error or self.draining) and time.monotonic() < deadline:
            await asyncio.sleep(START_POLL_S)
        self.check_ready()

    def max_num_seqs(self) -> int:
        """The default model's batch size limit (from its config when it is not loaded now)."""
        model = self.models.default
        if model.async_engine is not None:
            return model.async_engine.front.max_num_seqs
        return model.spec.config.scheduler.max_num_seqs

    def resolve_model(self, name: str | None, user: str | None = None) -> ServedModel:
        """The model serving a request's `model` field: none is the default; a --route name picks one of its
        models by weight (sticky per `user`); anything else must be a served model's name (else 404)."""
        if name is None:
            return self.models.default
        split = self.splits.get(name)
        if split is not None:
            name = split.pick(user, self._rng)
        model = self.models.get(name) or self._adapter_base(name)
        if model is None:
            raise APIError(404, f"model {name[:80]!r} does not exist (this server serves "
                           f"{', '.join(repr(n) for n in self.model_names())})"[:400], param="model",
                           code="model_not_found")
        return model

    def _adapter_base(self, name: str) -> ServedModel | None:
        """The model with a LoRA adapter called `name`: registered on its loaded engine, or, when it is not loaded
        now (the request then loads it), named by its --lora-modules or kept from before its unload."""
        for model in self.models.models.values():
            engine = model.async_engine
            if engine is not None:
                loras = engine.front.loras
                if loras is not None and loras.lookup(name) is not None:
                    return model
                continue
            lora = model.spec.config.lora if model.spec.config is not None else None
            if lora is not None and (any(n == name for n, _ in lora.modules) or self.adapter_owners.kept(model.name,
                                                                                                       name)):
                return model
        return None

    def model_names(self) -> list[str]:
        """Every name a request may use: the served models, then the routes."""
        return [*self.models.models, *self.splits]

    async def bind(self, model: ServedModel, on_release: list) -> "ModelState":
        """Lease `model` for the request (released through `on_release`), wait for it to be loaded, bind to it."""
        on_release.append(self.models.lease(model))
        try:
            await self.models.ready(model)
        except ModelLoadError as e:
            reason = "model_loading" if e.timed_out else None  # a failed load is a fault: a 5xx
            raise APIError(503, str(e), headers={"Retry-After": "5" if e.timed_out else "30"}, reason=reason) from None
        return ModelState(self, model)

    def check_rules(self, record: RequestRecord, prompt_token_counts: list[int]) -> None:
        """The operator's validation rules (--validation-rules); a `reject` rule answers 400."""
        if self.ops.rules is None:
            return
        from lmserve.ops.rules import RuleViolation

        try:
            self.ops.check(record, prompt_token_counts)
        except RuleViolation as e:
            raise APIError(400, str(e), param=e.param, code="rule_violation", reason="validation_rule") from None



def state_of(request: Request) -> ServerState:
    return request.app.state.lm


RECORD_KEY = "lmserve_record"  # where the Observe middleware puts the request's record in scope["state"]
KEY_NAME_KEY = "lmserve_key_name"  # where the auth middleware puts the API key's name
CHARGED_KEY = "lmserve_rate_charged"  # the auth middleware took the request from the key's rate bucket
LOADING_KEY = "lmserve_model_loading"  # a 503 because the request's model is loading (counted as not_ready)
LEASES_KEY = "lmserve_leases"  # the models a request holds (server/models/pool.py), released at its end
IGNORED_FIELDS_KEY = "lmserve_ignored_fields"  # unknown body fields dropped by parsing (server/access_log.py)
_PROMPT_FIELDS = ("prompt", "inputs", "messages", "input")  # "input": the Responses API's


def record_of(request: Request) -> RequestRecord:
    """The request's record, opened by the Observe middleware (a detached one for routes it does not watch)."""
    record = request.scope.get("state", {}).get(RECORD_KEY)
    return record if record is not None else RequestRecord("", request.url.path)


def arrived_at(request: Request) -> float | None:
    """When (monotonic) the StartGate took the request: a wait for the start-up load counts from there."""
    return request.scope.get("state", {}).get(ARRIVED_KEY)


def key_name_of(request: Request) -> str:
    """The name of the request's API key (set by the auth middleware); "anonymous" on a server without keys."""
    return request.scope.get("state", {}).get(KEY_NAME_KEY, ANONYMOUS)


def quota_of(request: Request) -> StorageQuota:
    """What the request's API key may store: the server's --storage-quota with its key file entry's own in place,
    and by default an equal share of the response cache for each key."""
    st = state_of(request)
    usage = st.tenants.usage.get(key_name_of(request))
    quota = st.config.storage_quota.merged(usage.spec.storage_quota if usage is not None else ())
    if quota.cache_entries is None and st.response_cache is not None:
        share = st.response_cache.settings.max_entries // len(st.tenants.usage)
        quota = replace(quota, cache_entries=max(1, share))
    return quota


# A body this large is parsed (and copied into its record) in a worker thread. On the event loop, 1.2 MB of
# logit_bias held every other client's first token for up to 1 s on a loaded 2-core Zen 3: json.loads, pydantic
# and model_dump are each tens of milliseconds per MB, and a thread lets the loop in between them.
OFF_LOOP_BYTES = 2**18


async def read_request(request: Request, model: type[T]) -> tuple[ModelState, T]:
    """Every API route's prologue: the server is ready, the body parses strictly, the model is one we serve and the
    key may use, and it is loaded (waiting for its load); the model is held until the response ends."""
    st = state_of(request)
    await st.wait_ready(arrived_at(request))
    ignored = request.scope.setdefault("state", {}).setdefault(IGNORED_FIELDS_KEY, [])  # access_log names them
    raw = await request.body()
    off_loop = len(raw) > OFF_LOOP_BYTES
    args = (raw, model, st.config.strict_fields, ignored)
    req = await asyncio.to_thread(parse_body, *args) if off_loop else parse_body(*args)
    _log_ignored(ignored, request.url.path)
    leases = request.scope["state"].setdefault(LEASES_KEY, [])
    return await accept(st, req, record_of(request), key_name_of(request), leases, off_loop), req


async def read_data(st: ServerState, data: Any, model: type[T], record: RequestRecord,
                    leases: list) -> tuple[ModelState, T]:
    """read_request for a body already parsed from JSON (a batch job's line); record.key_name is whose job it is.

    The caller releases what `leases` holds once the line's answer is complete."""
    await st.wait_ready()
    ignored: list[str] = []
    req = parse_data(data, model, st.config.strict_fields, ignored)
    _log_ignored(ignored, record.route)
    return await accept(st, req, record, record.key_name or ANONYMOUS, leases), req


def _log_ignored(ignored: list[str], route: str) -> None:
    if ignored:
        log.info("%s: ignored unknown field(s) %s (--strict-fields refuses them)", route[:100], ", ".join(ignored))


async def accept(st: ServerState, req: BaseModel, record: RequestRecord, key_name: str,
                 leases: list, off_loop: bool = False) -> ModelState:
    """The body names a model we serve and the key may use (as it asked for it, a route name included); its
    parameters go into the record under the name of the model that answers."""
    asked = getattr(req, "model", None)
    # Checked as asked, before the name is resolved, so a name the key may not use is one 404 whether it exists
    # or not: a route by its name, an adapter by its own (an adapter does not inherit its base's permission).
    if asked is not None:
        st.tenants.check_model(key_name, asked)
    served = st.resolve_model(asked, getattr(req, "user", None))
    if asked is None:
        st.tenants.check_model(key_name, served.name)
    body = await asyncio.to_thread(_dump, req) if off_loop else _dump(req)
    _describe(record, body, served.name)
    if asked in st.splits:
        record.requested_model = asked
    return await st.bind(served, leases)


def release_leases(scope: dict) -> None:
    """End the request's hold on its model (the auth middleware calls it when the response has ended)."""
    for model in scope.get("state", {}).pop(LEASES_KEY, ()):
        model.release()


def _dump(req: BaseModel) -> dict:
    return req.model_dump(exclude_unset=True, mode="json")


def _describe(record: RequestRecord, body: dict, served_name: str) -> None:
    """Copy what the client asked for (`body`, its dump) into the record: parameters (TGI's flattened), prompt or
    messages."""
    record.model = served_name
    record.prompt = body.get("prompt", body.get("inputs"))
    record.messages = body.get("messages")
    params = {k: v for k, v in body.items() if k not in _PROMPT_FIELDS}
    params.update(params.pop("parameters", None) or {})
    record.params = params
    record.stream = bool(params.get("stream", False))


def launch_engine(state: ServerState, config: EngineConfig, on_dead: Callable[[], None] | None = None,
                  name: str | None = None) -> AsyncEngine:
    """Build a model's engine from `config`, warm it up and start it behind `state` (blocking: a worker thread or
    the offline runner calls it); the server's one place that constructs an engine."""
    opened = open_engine(config)
    return start_engine(state, opened.engine, opened.warmup_seconds, on_dead, name)


def start_engine(state: ServerState, engine: LLMEngine, warmup_seconds: float,
                 on_dead: Callable[[], None] | None = None, name: str | None = None) -> AsyncEngine:
    """Start the engine thread behind `state` and its metrics, as model `name` (None: the default model, whose
    routes serve from here on); returns the AsyncEngine.

    `on_dead` runs (on the engine thread) once the engine has failed for good.
    """
    async_engine = serve_engine(engine, state.config.engine_step_timeout)
    async_engine.step_listeners.append(state.metrics.on_step)
    async_engine.fault_listeners.append(state.metrics.on_fault)
    if on_dead is not None:
        async_engine.fault_listeners.append(lambda fault: on_dead() if fault.fatal else None)
    state.metrics.bind_engine(async_engine.front, warmup_seconds, name)
    if state.response_cache is not None:  # the weights as loaded, before a swap on disk could change them
        state.response_cache.bind_engine(async_engine.front)
    async_engine.start()
    if name is None:
        state.async_engine = async_engine
    return async_engine
