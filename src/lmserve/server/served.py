"""ModelState: the server as one request sees it, the shared ServerState plus the one model the request resolved to.

Routes get it from state.read_request; everything model-specific (the engine, tokenizing, admission, the
engine stream) goes through it, everything shared (metrics, keys, ops, config) is the ServerState's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Union

from lmserve.errors import RequestRejected
from lmserve.lora.peft_adapter import AdapterError
from lmserve.ops.record import RequestRecord
from lmserve.request import CompletionDelta, EngineRequest, LoRARequest
from lmserve.sampling_params import SamplingParams
from lmserve.server.config import ServerConfig
from lmserve.server.errors import CONTEXT_LENGTH_EXCEEDED, APIError
from lmserve.server.key_file import ANONYMOUS
from lmserve.server.media import FetchedImage, ImageSource, decode_images, fetch_images, load_images
from lmserve.server.metrics import ServerMetrics
from lmserve.server.models.pool import ServedModel
from lmserve.server.models.traffic import TrafficSplit
from lmserve.server.response_cache import ResponseCache
from lmserve.server.streams import MergedStreams
from lmserve.server.tenants import Tenants
from lmserve.structured.compiler import Compiled

# A request's first prompts, up to INLINE_WORK characters in all (an id counts half: checking one costs about half a
# character's tokenizing), are tokenized and checked on the event loop rather than in a thread (asyncio.to_thread):
# a hop there and back took 130-320 us on a 2-vCPU Zen 1 VM, more than tokenizing 256 characters (~150 us), and a
# one-sentence embedding made three. The rest, and every longer prompt, goes off the loop: a 4 MiB text, or 300
# short inputs in one request, would stall every other request.
INLINE_WORK = 256


def _work(prompt: object) -> int | None:
    """What tokenizing or checking `prompt` costs, in characters; None for a rendered chat (never inline)."""
    if isinstance(prompt, str):
        return len(prompt)
    return (len(prompt) + 1) // 2 if isinstance(prompt, list) else None


class SharedState(Protocol):
    """What a ModelState uses of the server-wide state (server/state.ServerState), typed here so that this module
    does not import state.py, which imports it."""

    config: ServerConfig
    metrics: ServerMetrics
    tenants: Tenants
    response_cache: ResponseCache | None
    in_flight: int
    splits: dict[str, TrafficSplit]

    def check_rules(self, record: RequestRecord, prompt_token_counts: list[int]) -> None: ...


@dataclass(frozen=True)
class Chat:
    """A chat prompt: messages rendered by the model's chat template (extra variables such as `tools`), and the
    images its `{"type": "image"}` parts stand for, in order (checked references: start loads them)."""

    messages: list[dict]
    template_kwargs: dict | None = None
    images: tuple[ImageSource, ...] = ()


Prompt = Union[str, list[int], Chat]  # a raw prompt (special tokens parsed), token ids, or a chat
Rendered = Any  # a raw prompt, token ids, or a chat rendered by its template (the tokenizer's RenderedChat)


@dataclass(frozen=True)
class Started:
    """A request admitted and its engine streams running: one per prompt, merged."""

    request_id: str
    ids: list[list[int]]  # each prompt's token ids
    merged: MergedStreams
    lora: LoRARequest | None  # the adapter that runs (None: the model itself)


@dataclass(frozen=True)
class Admitted:
    """A beam search admitted: its id, each prompt's ids and resolved max_tokens, and the adapter that runs."""

    request_id: str
    ids: list[list[int]]
    max_tokens: list[int]
    lora: LoRARequest | None
    request: EngineRequest  # each beam step's engine request is this one with its id, prompt, params and max_tokens


class ModelState:
    """The server-wide state (config, metrics, tenants, response cache, routes) bound to one loaded model."""

    def __init__(self, shared: SharedState, model: ServedModel) -> None:
        self.shared, self.model = shared, model
        # Captured once: a request keeps its engine to the end (its lease keeps the model from unloading).
        self.async_engine = model.async_engine
        # The model's front end: tokenizer, limits, checks, grammars, adapters (never the engine's internals).
        self.front = self.async_engine.front
        # The server-wide parts a route reads (all set at start-up, before any request binds a model).
        self.config: ServerConfig = shared.config
        self.metrics: ServerMetrics = shared.metrics
        self.tenants: Tenants = shared.tenants
        self.response_cache: ResponseCache | None = shared.response_cache
        self.splits: dict[str, TrafficSplit] = shared.splits

    @property
    def model_name(self) -> str:
        """The served name of the model answering: what responses' `model` field and the metrics say."""
        return self.model.name

    @property
    def supports_images(self) -> bool:
        """Whether the model reads images (a vision tower); a text model's requests may hold none."""
        return self.front.supports_images

    def check_images(self, count: int, param: str = "messages") -> None:
        """400 naming the model when a request holding `count` images asks a model without a vision tower."""
        if count and not self.supports_images:
            raise APIError(400, f"model {self.model_name!r} does not accept images (it has no vision tower); send "
                           "text only, or ask a vision model", param=param, code="images_not_supported")

    async def lora_for(self, name: str | None, record: RequestRecord) -> LoRARequest | None:
        """The adapter a request's model name picks on this model (read from disk off the event loop unless
        cached); None for the model itself or a route; any other name is a 404, as is an adapter the record's
        key may not use (TGI's adapter_id arrives here unchecked)."""
        loras = self.front.loras
        if name is None or name == self.model.name or name in self.shared.splits:
            return None
        self.tenants.check_model(record.key_name or ANONYMOUS, name)
        if loras is None or loras.lookup(name) is None:  # TGI's adapter_id: not checked by resolve_model
            raise APIError(404, f"model {name[:80]!r} does not exist (this server serves {self.model.name!r} and "
                           "its adapters)", param="model", code="model_not_found")
        try:
            lora = await asyncio.to_thread(loras.get, name)
        except AdapterError as e:  # its directory changed on disk since it was registered
            raise APIError(400, str(e), param="model") from None
        if lora is None:  # unloaded between the lookup and the read
            raise APIError(404, f"model {name[:80]!r} does not exist (its adapter was unloaded)", param="model",
                           code="model_not_found")
        return lora

    async def start(self, prompts: list[Prompt], params: SamplingParams, record: RequestRecord, *, model: str | None,
                    id_prefix: str, numbered: bool = False, **fields: Any) -> Started:
        """The one admission path of every API family: the key's rate -> render chats -> size and token quota by
        the prompts' byte bounds -> tokenize -> compile the grammar -> resolve the adapter (`model`: the name the
        request asked for) -> admit -> start each prompt's engine stream.

        Each step's refusal is an APIError before anything reaches the engine, and the limits come before the work
        they guard; the request id is `{id_prefix}-{hex}` and lands in `record`; stream i runs as `{id}-{i}` when
        `numbered` (completions, whose prompt list may hold several) and as the id itself otherwise (one prompt).
        `fields`: the EngineRequest fields the route sets (its priority, the body's own: see EngineRequest).
        """
        self.charge(record)
        sources = [s for p in prompts if isinstance(p, Chat) for s in p.images]
        self.check_images(len(sources))
        fetched = await fetch_images(sources, self.config.media)  # bytes and header sizes: no pixel decoded yet
        rendered = [await self._render(p, record) for p in prompts]
        await self._check_bounds(rendered, params, record)
        ids = [await (self.tokenize(p, record) if isinstance(p, (str, list)) else self._encode_chat(p, record))
               for p in rendered]
        if fetched:  # counted from the headers' sizes, then decoded and expanded (before the context check)
            ids, fields["mm_inputs"] = await self._with_images(ids, fetched, params)
        grammar = await self.compile_grammar(params)
        lora = await self.lora_for(model, record)
        # Nothing awaits from admission until the streams are counted in flight.
        max_tokens = self.admit(ids, params, record)
        rid = record.request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        names = [f"{rid}-{i}" for i in range(len(ids))] if numbered else [rid]
        fields = self._fields(record, {**fields, "grammar": grammar, "lora": lora})
        merged = MergedStreams([self.generate(EngineRequest(name, p, params, n, **fields), record, i * params.n)
                                for i, (name, p, n) in enumerate(zip(names, ids, max_tokens))])
        return Started(rid, ids, merged, lora)

    async def _with_images(self, ids: list[list[int]], fetched: list[FetchedImage],
                           params: SamplingParams) -> tuple[list[list[int]], tuple]:
        """The one prompt's image markers expanded to the model's placeholder tokens, and its images as the engine
        takes them (engine/front.py expand_images); a 400 for a text-only model, markers that miss images, or a
        prompt the images would take past the context: that one counted from the images' sizes (their headers)
        before any is decoded, so a request of many images past the context costs no decode or resize."""
        if len(ids) != 1:
            raise APIError(400, "images go with exactly one prompt", param="messages")
        sizes = [(f.width, f.height) for f in fetched]
        try:
            await asyncio.to_thread(self.front.check_image_tokens, ids[0], sizes, params)
        except RequestRejected as e:
            raise _refused(e) from None
        return await self._expand_images(ids, tuple(await decode_images(fetched)))

    async def _expand_images(self, ids: list[list[int]], images: tuple) -> tuple[list[list[int]], tuple]:
        """The one prompt's image markers expanded (engine/front.py expand_images), no context check: that is
        admission's, or `_with_images`'."""
        if len(ids) != 1:
            raise APIError(400, "images go with exactly one prompt", param="messages")
        try:
            expanded, mm = await asyncio.to_thread(self.front.expand_images, ids[0], images)
        except RequestRejected as e:
            raise APIError(400, str(e), param=e.param or "messages", reason="invalid_request") from None
        return [expanded], mm

    def _fields(self, record: RequestRecord, fields: dict[str, Any]) -> dict[str, Any]:
        """The EngineRequest fields admission sets beside the route's `fields`: who asked, and who may share the
        prompt's prefix-cache blocks (per key unless the key's `prefix_cache: shared` opts in: Tenants.prefix_scope)."""
        return {**fields, "tenant": record.key_name or "",
                "prefix_scope": self.tenants.prefix_scope(record.key_name or ANONYMOUS)}

    def charge(self, record: RequestRecord) -> None:
        """Take the request from its key's rate bucket unless that was done before (the HTTP middleware does it for
        every request that does work; a batch line is charged here)."""
        if not record.rate_charged:
            self.tenants.take_request(record.key_name or ANONYMOUS)
            record.rate_charged = True

    async def _check_bounds(self, prompts: list[Rendered], params: SamplingParams,
                            record: RequestRecord) -> None:
        """Before tokenizing: 400 when a prompt cannot fit the context even at the fewest tokens its bytes can be,
        and the key's token quota by the prompts' bounds (Tenants.hold). Off the event loop unless the prompts are
        small (INLINE_WORK) and the bounds built: counting a 4 MiB text's UTF-8 bytes copies it."""
        try:
            works = [_work(p) for p in prompts]  # counting bytes: far cheaper than tokenizing, not charged
            if None not in works and sum(works) <= INLINE_WORK and self.front.tokenizer.bounds_built:
                bounds = self.front.prompt_bounds(prompts, params)
            else:
                bounds = await asyncio.to_thread(self.front.prompt_bounds, prompts, params)
        except RequestRejected as e:
            raise APIError(400, str(e), param=e.param, code=CONTEXT_LENGTH_EXCEEDED, reason="context_length") from None
        completions = params.n * len(prompts)
        self.tenants.hold(record, bounds.fewest + completions * (params.max_tokens or 0),
                          bounds.most + completions * (params.max_tokens or self.front.max_model_len))

    async def admit_beams(self, prompts: list[str | list[int]], width: int, max_tokens: int, record: RequestRecord, *,
                          model: str | None, id_prefix: str, **fields: Any) -> Admitted:
        """The admission path of a beam search (server/api/openai/routes.py drives it): rate -> byte bounds -> tokenize ->
        adapter -> admit as `width` completions of `max_tokens` per prompt; each step's beams then run through
        generate(); `fields` as start's."""
        self.charge(record)
        params = SamplingParams(n=width, max_tokens=max_tokens, temperature=0.0)
        await self._check_bounds(prompts, params, record)
        ids = [await self.tokenize(p, record) for p in prompts]
        lora = await self.lora_for(model, record)
        # Each step runs every beam as an engine request: the beams count against the queue as requests do.
        beams, limit = len(ids) * width, self.front.max_num_seqs + self.config.max_queued_requests
        if beams > limit:
            raise APIError(400, f"{len(ids)} prompt(s) x {width} beams = {beams} beams, more than this server runs and "
                           f"queues at once ({limit}); send fewer prompts or a smaller best_of", param="best_of")
        self._check_room(beams)
        limits = self.admit(ids, params, record)
        rid = record.request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        fields = self._fields(record, {**fields, "lora": lora})
        return Admitted(rid, ids, limits, lora, EngineRequest(rid, [], params, **fields))

    def admit(self, prompts: list[list[int]], params: SamplingParams, record: RequestRecord) -> list[int]:
        """Validate against the engine and the queue limit before anything reaches the engine thread.

        Returns each prompt's resolved max_tokens for generate: this is the only check_request of the request.

        Queue rule: each prompt of a request is one engine request (its n completions included), and
        engine requests count from admission until their stream ends. A request is refused with 503 +
        Retry-After when the model's in-flight engine requests plus its own prompts would exceed
        max_num_seqs + max_queued_requests (the running batch plus the queue we accept to hold).
        """
        max_tokens = [self._check(ids, params) for ids in prompts]
        record.prompt_tokens = sum(len(ids) for ids in prompts)
        self.shared.check_rules(record, [len(ids) for ids in prompts])
        self._check_room(len(prompts))
        # The key's tokens come last, so a request refused for any other reason costs the key no tokens (its
        # request was taken before any work: charge).
        self.tenants.admit(record, record.prompt_tokens + params.n * sum(max_tokens))
        self.metrics.model_requests.labels(self.model_name).inc()
        return max_tokens

    def _check_room(self, engine_requests: int) -> None:
        """503 + Retry-After when the model's in-flight engine requests plus these would pass the queue limit."""
        limit = self.front.max_num_seqs + self.config.max_queued_requests
        if self.model.in_flight + engine_requests > limit:
            raise APIError(503, f"the server is at capacity ({limit} requests in flight); retry shortly",
                           headers={"Retry-After": "1"}, reason="queue_full")

    def _check(self, ids: list[int], params: SamplingParams) -> int:
        """front.check_request as an HTTP 400; returns the prompt's resolved max_tokens."""
        try:
            return self.front.check_request(ids, params)
        except RequestRejected as e:
            raise _refused(e) from None

    async def compile_grammar(self, params: SamplingParams) -> Compiled | None:
        """The request's compiled grammar (None when unconstrained), compiled off the event loop and the engine thread.

        Bounded by the engine's StructuredOutputsConfig: an invalid or too costly spec is a 400 naming it.
        """
        so = params.structured_outputs
        if so is None:
            return None
        self.metrics.structured_requests.labels(so.kind).inc()
        try:
            compiled = await asyncio.to_thread(self.front.compile_grammar, params)
        except RequestRejected as e:
            raise APIError(400, str(e), param="structured_outputs", reason="invalid_request") from None
        self.metrics.grammar_compile.labels("hit" if compiled.cached else "miss").observe(compiled.seconds)
        return compiled

    def generate(self, request: EngineRequest, record: RequestRecord,
                 first_output: int = 0) -> AsyncIterator[CompletionDelta]:
        """An engine stream that counts toward the in-flight limits (the server's and the model's) until it ends.

        `request` is what admission made (its max_tokens what admit returned for its prompt). Its completions fill
        record.outputs[first_output + index] (several prompts share one record).
        """
        if record.engine_arrival is None:
            record.engine_arrival = time.monotonic()
        shared, model = self.shared, self.model
        shared.in_flight += 1
        model.in_flight += 1
        self.metrics.in_flight.set(shared.in_flight)
        key = record.key_name or ANONYMOUS
        inner = self.async_engine.generate(request)

        async def counted():
            started, first, last = time.monotonic(), {}, {}  # per completion index
            try:
                async for d in inner:
                    self._observe(d, started, first, last)
                    if d.finished:
                        self.tenants.count_prefix_hits(key, d.num_cached_tokens)
                    _record_delta(record, first_output, d)
                    yield d
            finally:
                await inner.aclose()
                shared.in_flight -= 1
                model.in_flight -= 1
                self.metrics.in_flight.set(shared.in_flight)

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
            m.model_generation_tokens.labels(self.model_name).inc(d.num_output_tokens)
            m.on_finished(d, started, first.get(d.index), now)

    async def tokenize(self, prompt: str | list[int], record: RequestRecord) -> list[int]:
        """Tokenize a raw prompt (special tokens parsed) or check ids, off the event loop unless the request's small
        work so far allows (INLINE_WORK: long prompts stall it)."""
        start = time.monotonic()
        try:
            work = _work(prompt)
            if work is not None and record.inline_work + work <= INLINE_WORK:
                record.inline_work += work
                return self.front.tokenize_prompt(prompt)
            return await asyncio.to_thread(self.front.tokenize_prompt, prompt)
        except RequestRejected as e:
            raise APIError(400, str(e), param="prompt") from None
        finally:
            record.tokenize_s += time.monotonic() - start

    async def tokenize_chat(self, messages: list[dict], record: RequestRecord,
                            template_kwargs: dict | None = None) -> list[int]:
        """Render the chat template (with extra variables such as `tools`) and tokenize, off the event loop."""
        return await self._encode_chat(await self._render(Chat(messages, template_kwargs), record), record)

    async def count_chat(self, chat: Chat, record: RequestRecord) -> int:
        """A chat's prompt tokens as start counts them: each image's placeholder tokens included (its images are
        loaded and preprocessed, as a request's would be; a bad one is the same 400)."""
        self.check_images(len(chat.images))
        ids = [await self.tokenize_chat(chat.messages, record, chat.template_kwargs)]
        if chat.images:
            ids, _ = await self._expand_images(ids, tuple(await load_images(chat.images, self.config.media)))
        return len(ids[0])

    async def _render(self, prompt: Prompt, record: RequestRecord) -> Rendered:
        """A chat rendered by its template, off the event loop (a raw prompt or ids as they are)."""
        if not isinstance(prompt, Chat):
            return prompt
        start = time.monotonic()
        try:
            return await asyncio.to_thread(self.front.tokenizer.render_chat, prompt.messages, True,
                                           **(prompt.template_kwargs or {}))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        finally:
            record.tokenize_s += time.monotonic() - start

    async def _encode_chat(self, chat: Rendered, record: RequestRecord) -> list[int]:
        start = time.monotonic()
        try:
            return await asyncio.to_thread(self.front.tokenizer.encode_rendered, chat)
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
        if d.index == 0:  # a prompt's n completions share its cached blocks: counted once
            record.num_cached_tokens += d.num_cached_tokens
        out.cumulative_logprob = d.cumulative_logprob
        if d.timings is not None:  # the slowest completion of the request sets its phases
            t = d.timings
            record.queue_s, record.prefill_s = max(record.queue_s, t.queue_s), max(record.prefill_s, t.prefill_s)
            record.decode_s, record.detokenize_s = max(record.decode_s, t.decode_s), max(record.detokenize_s,
                                                                                         t.detokenize_s)
            record.num_preemptions += t.num_preemptions


def _refused(e: RequestRejected) -> APIError:
    """check_request's refusal as an HTTP 400: one naming the prompt is a context-length error."""
    too_long = e.param == "prompt"
    return APIError(400, str(e), param=e.param, code=CONTEXT_LENGTH_EXCEEDED if too_long else None,
                    reason="context_length" if too_long else "invalid_request")
