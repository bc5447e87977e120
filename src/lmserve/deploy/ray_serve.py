"""lmserve replicas on Ray Serve: `serve run lmserve.deploy.ray_serve:app model=PATH num_replicas=2`.

Two deployments. `LMServerEngine` replicas each load one engine behind the app `lmserve serve` serves
(server/app.build_app), so every route, SSE stream, error body and API-key check is the same code. The
`OpenAIIngress` (no CPUs of its own) takes each HTTP request from Serve's proxy, reads it once, computes
its routing key (forward.routing_key: a digest of the prompt's first `prefix_chars` characters) and
streams it through a handle to the engine replicas, whose router (router.PrefixAffinityRouter, Ray
Serve's request-router extension point) sends equal keys to the same replica so prefix caching keeps
working. A replica's engine can only see the body after Serve's proxy has picked a replica, which is why
the ingress is a deployment of its own. Without `num_replicas` the engine deployment autoscales on
ongoing requests per replica (`target_ongoing_requests`, between `min_replicas` and `max_replicas`).

Every response carries `x-lmserve-replica`: the engine replica that answered (a request with that header
goes to the replica it names while it runs, e.g. to read its /metrics). A replica that dies
before answering turns into a 503 with Retry-After (clients retry, Serve starts a new replica); one that
dies in the middle of a stream ends it with an error event.

With `prefill_replicas=N` (and `--kv-shared` in serve_args) the app disaggregates prefill and decode
(deploy/pd.py): a third deployment, `LMServerPrefill`, computes long prompts into the shared KV tier, and the
engine replicas become the decode role; the ingress falls back to colocated serving on them when the prefill
role is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shlex
from dataclasses import dataclass

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lmserve.cli import parse_args
from lmserve.deploy.forward import ForwardedRequest, ResponseStart, routing_key, run_asgi
from lmserve.deploy.lifespan import Lifespan
from lmserve.deploy.pd import ACCEPTED, PrefillClient
from lmserve.deploy.router import DEFAULT_IMBALANCED_THRESHOLD, PrefixAffinityRouter
from lmserve.errors import ConfigError
from lmserve.server.app import build_app, error_response
from lmserve.server.errors import APIError, error_body
from lmserve.server.main import check_serve_args, load_engine, prepare, unload_engine

log = logging.getLogger("lmserve.deploy")
REPLICA_HEADER = b"x-lmserve-replica"
ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, PREFILL_DEPLOYMENT = "LMServerEngine", "OpenAIIngress", "LMServerPrefill"


@dataclass(frozen=True)
class RayServeArgs:
    """The application's arguments (`serve run ... key=value`, or `args:` in a Serve config file)."""

    model: str | None = None  # a path or Hub id; None: the embedded SmolLM2
    num_replicas: int | None = None  # a fixed count; None: autoscale between min and max
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 8.0  # autoscaling aims at this many requests in flight per replica
    max_ongoing_requests: int = 32  # per replica; past it, Serve routes elsewhere or queues
    num_threads: int = 1  # torch threads per replica, and the CPUs Ray reserves for it
    num_gpus: float = 0.0
    prefix_chars: int = 256  # prompts equal on this many leading characters share a replica
    imbalanced_threshold: int = DEFAULT_IMBALANCED_THRESHOLD
    health_check_period_s: float = 10.0
    serve_args: str = ""  # further `lmserve serve` flags, e.g. "--require-api-key --api-key-file /etc/keys.yaml"
    # P/D (deploy/pd.py): prefill replicas (0: colocated serving only); they need --kv-shared in serve_args
    prefill_replicas: int = 0
    pd_min_prompt_chars: int = 4000  # prompts with this much text (~1,000 tokens) are prefilled first
    pd_start_timeout_s: float = 2.0  # no prefill replica took the prompt in this long: decode computes it
    pd_timeout_s: float = 60.0  # a prefill that runs longer is abandoned: decode computes the prompt
    pd_retry_s: float = 5.0  # after a prefill failure, prompts go straight to decode for this long

    @classmethod
    def from_args(cls, args: dict) -> "RayServeArgs":
        """Typed arguments from strings (the CLI's) or YAML values; an unknown key is an error naming the known."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(args) - set(fields)
        if unknown:
            raise ConfigError(f"unknown argument(s) {sorted(unknown)}; known: {sorted(fields)}")
        values = {}
        for name, value in args.items():
            kind = str(fields[name].type).split(" |")[0]  # "int | None" -> "int" (annotations are strings here)
            if value is None or (name == "num_replicas" and value in ("", "auto")):
                values[name] = None
                continue
            try:
                values[name] = {"int": int, "float": float}.get(kind, str)(value)
            except ValueError:
                raise ConfigError(f"argument {name}={value!r} is not a{'n' if kind == 'int' else ''} {kind}") from None
        return cls(**values)

    def serve_argv(self) -> list[str]:
        """The `lmserve serve` command line each engine replica starts from."""
        model = ["--model", self.model] if self.model else []
        return ["serve", *model, "--num-threads", str(self.num_threads), *shlex.split(self.serve_args)]


def parse_serve_args(argv: list[str]):
    """`lmserve serve` flags parsed and checked; a mistake is a ConfigError, never argparse's sys.exit."""
    try:
        args = parse_args(argv)
    except SystemExit:
        raise ConfigError(f"bad lmserve serve flags: {shlex.join(argv[1:])} (see lmserve serve --help)") from None
    check_serve_args(args)
    return args


class EngineReplica:
    """One lmserve engine behind lmserve's own ASGI app; Serve calls `forward` through the ingress's handle."""

    async def __init__(self, argv: list[str]) -> None:
        self.state = state = prepare(parse_serve_args(argv))
        self.app = build_app(state)
        # the default model now, any other --model in serve_args on its first request (as `lmserve serve`)
        state.models.loader = lambda model: load_engine(state, model.spec, None)
        state.models.unloader = lambda model, engine: unload_engine(state, model, engine)
        default = state.models.default
        state.async_engine = await asyncio.get_running_loop().run_in_executor(
            None, load_engine, state, default.spec, None)
        self.lifespan = await Lifespan.start(self.app)  # the batch-job runner, as uvicorn would start it
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        log.info("replica %s serving %s", self.replica_id, self.state.config.served_model_name)

    async def prefill(self, req: ForwardedRequest):
        """P/D's prefill role: ACCEPTED at once, then the status of `req` (a one-token request, pd.prefill_body)
        once every block it computed is in the shared tier, where the decode replica will look for it."""
        yield ACCEPTED
        status = 500
        async for item in run_asgi(self.app, req):
            if isinstance(item, ResponseStart):
                status = item.status
        if status == 200:
            await asyncio.get_running_loop().run_in_executor(None, self._flush_kv)
        yield status

    def _flush_kv(self) -> None:
        for engine in self.state.models.engines():
            tier = getattr(engine.engine, "kv_tier", None)
            if tier is not None:
                tier.flush()

    def ping(self) -> str:
        """The ingress's health probe of the prefill role."""
        self.check_health()
        return self.replica_id

    async def forward(self, req: ForwardedRequest):
        """The response to `req`: a ResponseStart, then its body chunks as the app sends them."""
        async for item in run_asgi(self.app, req, ((REPLICA_HEADER, self.replica_id.encode()),)):
            yield item

    def check_health(self) -> None:
        """Serve's health check: a dead engine fails it, and Serve replaces the replica."""
        engine = self.state.async_engine
        if engine is None or not engine.alive:
            raise RuntimeError(f"the engine has stopped: {engine.dead if engine else 'not loaded'}")

    async def __del__(self) -> None:
        """Serve's graceful stop: end the batch runner and the engine thread, flush the ops outputs."""
        if hasattr(self, "lifespan"):  # __init__ may have failed part-way (Serve then retries the replica)
            await self.lifespan.stop()
        state = getattr(self, "state", None)
        if state is not None:
            for engine in state.models.engines():
                engine.shutdown()
            state.ops.close()


class Ingress:
    """Serve's HTTP entry: reads a request once, keys it by prompt prefix, streams an engine replica's answer."""

    def __init__(self, engine, prefix_chars: int, max_body_bytes: int, max_upload_bytes: int,
                 prefill=None, pd: dict | None = None) -> None:
        self.engine = engine.options(method_name="forward", stream=True)
        self.pd = PrefillClient(prefill, metrics=_pd_metrics(), **pd) if prefill is not None else None
        self.prefix_chars = prefix_chars
        self.limits = {"/v1/files": max_upload_bytes}
        self.max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        body = await self._read_body(request, self.limits.get(path, self.max_body_bytes))
        if isinstance(body, Response):
            return body
        client = (request.client.host, request.client.port) if request.client else None
        fwd = ForwardedRequest(request.method, path, request.url.query.encode(), tuple(request.headers.raw),
                               body, client, routing_key(path, body, self.prefix_chars),
                               request.headers.get(REPLICA_HEADER.decode()))
        if self.pd is not None:
            if path == "/health":
                return await self._health(fwd)
            await self.pd.before_decode(fwd)  # a long prompt's blocks into the shared tier, or a fallback
        stream = self.engine.remote(fwd)
        try:
            start = await stream.__anext__()
        except RayActorError as e:  # the replica died or is unreachable before it answered: nothing was done
            log.warning("engine replica unavailable for %s: %s", path, e)
            return error_response(path, APIError(503, "the engine replica serving this request is unavailable; "
                                                 "retry it", headers={"Retry-After": "1"}, reason="not_ready"))
        except StopAsyncIteration:  # the app sent nothing (it saw the client leave first)
            return error_response(path, APIError(500, "the engine replica sent no response"))
        except asyncio.CancelledError:  # the client left before the answer began (a whole, non-stream one)
            stream.cancel()  # the replica's app sees a disconnect and aborts the engine request
            raise
        return _relay(start, stream, path)

    async def _health(self, fwd: ForwardedRequest) -> Response:
        """A decode replica's /health, with the P/D figures and the roles missing: a missing prefill role leaves
        the status as decode's (it serves, colocated); no decode replica is a 503."""
        prefill_ok = await self.pd.available()
        try:  # bounded: with no decode replica running, Serve would queue the call
            status, body = await asyncio.wait_for(_whole(self.engine.remote(fwd)), 10)
        except (RayActorError, asyncio.TimeoutError):
            status, body = 503, b'{"status": "unavailable"}'
        try:
            health = json.loads(body)
        except ValueError:
            health = {"status": "unavailable"}
        missing = [role for role, ok in (("prefill", prefill_ok), ("decode", status == 200)) if not ok]
        health |= {"missing_roles": missing, "pd": self.pd.stats.as_dict()}
        return Response(json.dumps(health), status_code=status, media_type="application/json")

    @staticmethod
    async def _read_body(request: Request, limit: int) -> bytes | Response:
        """The whole body, or a 413 as soon as it passes `limit` (as lmserve's own BodyLimit)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return error_response(request.url.path, APIError(413, f"request body over {limit} bytes"))
            chunks.append(chunk)
        return b"".join(chunks)


async def _whole(stream) -> tuple[int, bytes]:
    """A short response's status and body."""
    start = await stream.__anext__()
    return start.status, b"".join([chunk async for chunk in stream])


def _pd_metrics() -> dict:
    """The ingress's P/D counters in Ray's metrics (exported by each node's metrics agent)."""
    from ray.serve.metrics import Counter

    return {"handoffs": Counter("lmserve_pd_handoffs", description="prompts a prefill replica computed first"),
            "fallbacks": Counter("lmserve_pd_fallbacks", tag_keys=("reason",),
                                 description="long prompts decode computed whole: the prefill role was missing")}


def _relay(start: ResponseStart, stream, path: str) -> StreamingResponse:
    """A response with the replica's status and headers (all of them, repeated ones too) over its chunks."""
    sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
    response = StreamingResponse(_chunks(stream, sse, path), status_code=start.status)
    response.raw_headers = list(start.headers)
    return response


async def _chunks(stream, sse: bool, path: str):
    """The body chunks; a replica dying mid-stream ends an SSE stream with an error event."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except RayActorError as e:
        log.warning("engine replica died in the middle of a response on %s: %s", path, e)
        if sse:
            err = APIError(503, "the engine replica serving this stream failed; retry the request")
            yield b"data: " + json.dumps(error_body(err)).encode() + b"\n\n"
    finally:
        if not finished:
            stream.cancel()  # the client left (or the replica failed): the replica's app sees a disconnect


def engine_options(cfg: RayServeArgs, name: str = ENGINE_DEPLOYMENT) -> dict:
    """Deployment options of the engine replicas: resources, routing, fixed count or autoscaling."""
    options = {
        "name": name,
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "health_check_period_s": cfg.health_check_period_s,
        "ray_actor_options": {"num_cpus": cfg.num_threads, "num_gpus": cfg.num_gpus},
        "request_router_config": RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": cfg.imbalanced_threshold}),
    }
    if cfg.num_replicas is not None:
        options["num_replicas"] = cfg.num_replicas
    else:
        options["autoscaling_config"] = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
                                         "target_ongoing_requests": cfg.target_ongoing_requests}
    return options


def app(args: dict):
    """The Serve application builder (`serve run lmserve.deploy.ray_serve:app key=value ...`).

    The lmserve flags are parsed and checked here, so a bad one fails the deploy once, not in each replica.
    """
    cfg = RayServeArgs.from_args(dict(args))
    flags = parse_serve_args(cfg.serve_argv())
    engine = serve.deployment(EngineReplica).options(**engine_options(cfg)).bind(cfg.serve_argv())
    ingress = serve.deployment(Ingress).options(name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
                                                max_ongoing_requests=1000)  # it only waits on replicas
    if cfg.prefill_replicas <= 0:
        return ingress.bind(engine, cfg.prefix_chars, flags.max_body_bytes, flags.max_upload_bytes)
    if flags.kv_shared is None:
        raise ConfigError("prefill_replicas needs a KV tier the replicas share: add --kv-shared redis://HOST:PORT/DB "
                          "(or a shared directory) to serve_args")
    prefill_cfg = dataclasses.replace(cfg, num_replicas=cfg.prefill_replicas)
    prefill = serve.deployment(EngineReplica).options(**engine_options(prefill_cfg, PREFILL_DEPLOYMENT)).bind(
        cfg.serve_argv())
    pd = {"min_prompt_chars": cfg.pd_min_prompt_chars, "start_timeout_s": cfg.pd_start_timeout_s,
          "timeout_s": cfg.pd_timeout_s, "retry_s": cfg.pd_retry_s}
    return ingress.bind(engine, cfg.prefix_chars, flags.max_body_bytes, flags.max_upload_bytes, prefill, pd)
