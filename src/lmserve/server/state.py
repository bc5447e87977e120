"""ServerState: what routes share (the engine handle, names, limits, metrics, lifecycle flags) and their prologue."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, TypeVar

from starlette.requests import Request

from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.llm_engine import LLMEngine, RequestRejected
from lmserve.request import CompletionDelta
from lmserve.sampling_params import SamplingParams
from lmserve.server.errors import APIError
from lmserve.server.metrics import ServerMetrics
from lmserve.server.protocol import parse_body

T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings (the engine has its own EngineConfig)."""

    served_model_name: str
    api_keys: tuple[str, ...] = ()
    cors_allowed_origins: tuple[str, ...] = ()
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 2**20
    drain_timeout: float = 30.0


@dataclass
class ServerState:
    """Mutable per-process state; `engine` is None while the model loads."""

    config: ServerConfig
    metrics: ServerMetrics
    async_engine: AsyncEngine | None = None
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine

    @property
    def ready(self) -> bool:
        return self.async_engine is not None and self.async_engine.alive and not self.draining

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if self.async_engine is None:
            raise APIError(503, "the model is still loading", headers={"Retry-After": "5"})
        if not self.async_engine.alive:
            raise APIError(503, "the engine has stopped", headers={"Retry-After": "30"})

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"model {name[:80]!r} does not exist (this server serves "
                           f"{self.config.served_model_name!r})", param="model", code="model_not_found")

    def admit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Validate against the engine and the queue limit before anything reaches the engine thread.

        Queue rule: each prompt of a request is one engine request (its n completions included), and
        engine requests count from admission until their stream ends. A request is refused with 503 +
        Retry-After when in-flight engine requests plus its own prompts would exceed
        max_num_seqs + max_queued_requests (the running batch plus the queue we accept to hold).
        """
        for ids in prompts:
            try:
                self.engine.check_request(ids, params)
            except RequestRejected as e:
                raise APIError(400, str(e), param="prompt") from None
        limit = self.engine.cfg.scheduler.max_num_seqs + self.config.max_queued_requests
        if self.in_flight + len(prompts) > limit:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(503, f"the server is at capacity ({limit} requests in flight); retry shortly",
                           headers={"Retry-After": "1"})

    def generate(self, request_id: str, ids: list[int], params: SamplingParams) -> AsyncIterator[CompletionDelta]:
        """An engine stream that counts toward the in-flight limit until it ends."""
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        inner = self.async_engine.generate(request_id, ids, params)

        async def counted():
            started, first, last = time.monotonic(), {}, {}  # per completion index
            try:
                async for d in inner:
                    self._observe(d, started, first, last)
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

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Tokenize (or check ids) off the event loop: a long prompt must not stall other requests."""
        try:
            return await asyncio.to_thread(self.engine.tokenize_prompt, prompt)
        except RequestRejected as e:
            raise APIError(400, str(e), param="prompt") from None


def state_of(request: Request) -> ServerState:
    return request.app.state.lm


async def read_request(request: Request, model: type[T]) -> tuple[ServerState, T]:
    """Every API route's prologue: the engine is ready, the body parses strictly, the model name is ours."""
    st = state_of(request)
    st.check_ready()
    req = parse_body(await request.body(), model)
    st.check_model(getattr(req, "model", None))
    return st, req
