"""A request as the engine tracks it, and the per-step deltas it produces (plain data)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from lmserve.sampling_params import SamplingParams

# Batch-job lines (`lmserve run-batch`, /v1/batches) wait behind every interactive request for a slot.
BATCH_PRIORITY = 1


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING)* -> FINISHED_*."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class BlockSalt(NamedTuple):
    """A prompt's prefix-cache salt that changes at a block: `before` for blocks [0, from_block), `after` from
    there on (a prompt with images: the images' digests join the salt from the block of the first image token, so
    the text before it is shared with any request, and nothing after it is shared without the same images)."""

    before: bytes
    after: bytes
    from_block: int

    def at(self, block: int) -> bytes:
        return self.after if block >= self.from_block else self.before


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to run with, as vLLM spells it: `LoRARequest(lora_name, lora_int_id, lora_path)`.

    The offline LLM takes one as its user wrote it (LLM._adapter registers `lora_path` under `lora_name` on first
    use, numbering registrations itself); a request runs with the one the adapter registry returns, its weights
    read from disk. There `lora_int_id` changes when a name is unloaded and loaded again, so slots and
    prefix-cache blocks of the old weights never serve the new ones. `adapter` is a lora.peft_adapter.PeftAdapter
    (typed loosely: plain data sits below the lora/ feature layer); holding it keeps its tensors alive while the
    request runs, even once the host cache has evicted it.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    adapter: object = field(repr=False, compare=False, default=None)

    @property
    def name(self) -> str:
        """The adapter's name (vLLM's alias of lora_name): the model name requests ask for."""
        return self.lora_name


@dataclass(frozen=True)
class EngineRequest:
    """One client request as the engine receives it: made once by the front end, passed whole to the scheduler.

    The one carrier of per-request fields from admission (server/served.py ModelState.start, or the offline
    LLMEngine.add_request) through AsyncEngine and LLMEngine to EngineFront.requests, which builds the scheduler's
    Requests from it (Request.completion). A new per-request field is added here, set by its producer and read by
    its consumer; nothing in between names it.
    """

    request_id: str  # the client-visible id; completion i of n > 1 runs as f"{request_id}#{i}"
    prompt: str | list[int]  # ids (the server tokenizes before admission), or text the front end tokenizes
    params: SamplingParams
    max_tokens: int | None = None  # from EngineFront.check_request; None: checked by EngineFront.requests
    # from EngineFront.compile_grammar (a structured.compiler.Compiled, compiled off the engine thread; typed
    # loosely because plain data sits below the structured/ feature layer); None: compiled there when needed
    grammar: object | None = None
    tenant: str = ""  # who asked (an API key's name): the scheduler admits round-robin across tenants
    priority: int = 0  # lower is admitted first: interactive requests 0, offline batch lines BATCH_PRIORITY
    lora: LoRARequest | None = None  # the adapter, already read from disk (LoraRegistry.get); None: the base model
    # who may share the prompt's prefix-cache blocks (b"": everyone), set at admission (server/tenants.py
    # Tenants.prefix_scope: per API key unless it shares); EngineFront.requests adds the adapter and images
    prefix_scope: bytes = b""
    # vLLM's `cache_salt`: the client's own; its prompt blocks are shared with every request sending the same salt,
    # whatever its prefix_scope (EngineFront.requests)
    cache_salt: str | None = None
    # The prompt's images (multimodal.image_io.ImageData, or PIL images from the offline API), in the order of
    # their markers (`<image>`) in the prompt; EngineFront.requests expands them (engine/images.py).
    mm_inputs: tuple[object, ...] = ()


@dataclass
class TokenLogprobs:
    """Logprob of one generated token and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first; empty when the request asked for none
    rank: int | None = None  # 1-based rank of token_id in the whole vocabulary (prompt logprobs)


@dataclass
class Request:
    """One sequence being generated. `n` > 1 completions are n Requests sharing a parent id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what fits in the context
    stop_token_ids: frozenset[int]  # ids that end generation here (eos unless ignore_eos, plus params')
    parent_id: str = ""
    index: int = 0  # which of the parent's n completions
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    seed: int | None = None  # this completion's own seed (the request's seed + index); the runner owns its RNG
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify in the next step
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # for prompt tokens 1.. (when asked)
    # mixed into prefix-cache hashes: blocks are shared only between requests of the same salt (the LoRA
    # adapter's id, then who may share, then the images: EngineFront.requests)
    prefix_salt: bytes | BlockSalt = b""
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, summed over admissions
    lora: LoRARequest | None = None  # None: the base model
    tenant: str = ""  # who asked (an API key's name): waiting requests are admitted round-robin across tenants
    priority: int = 0  # lower is admitted first: interactive requests 0, offline batch lines BATCH_PRIORITY
    # structured outputs: this sequence's structured.Grammar (its matcher state follows output_token_ids);
    # typed loosely because plain data sits below the structured/ feature layer
    grammar: object | None = None
    # params.reasoning_budget: this sequence's structured.reasoning_budget.ReasoningBudget (typed loosely, as grammar)
    reasoning_budget: object | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs
    detokenize_s: float = 0.0  # time spent turning this request's tokens into text
    # pooling requests (params.pooling): False when the model's pooling reads every prompt token's hidden state
    # (mean, CLS), so no prefix-cache hit may skip one; `embedding` is set when the prompt's last chunk has run
    may_reuse_prefix: bool = True
    embedding: list[float] | None = None
    # the prompt's images (multimodal.processor.MMInput, typed loosely as plain data): pixels, digest and the
    # prompt positions their embeddings fill; sent to the runner with the request, re-sent after a preemption
    mm_inputs: tuple[object, ...] = ()

    @classmethod
    def completion(cls, source: EngineRequest, index: int, prompt_ids: list[int], max_tokens: int,
                   stop_token_ids: frozenset[int], **computed: object) -> Request:
        """Completion `index` of `source`: its fields copied, plus what the front end computed for this completion
        (`computed`: grammar, reasoning_budget, prefix_salt, may_reuse_prefix)."""
        p, rid = source.params, source.request_id
        return cls(rid if p.n == 1 else f"{rid}#{index}", list(prompt_ids), p, max_tokens, stop_token_ids,
                   parent_id=rid, index=index, seed=None if p.seed is None else p.seed + index,  # seed + i: its own
                   tenant=source.tenant, priority=source.priority, lora=source.lora, **computed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """all_token_ids[start:] without building the whole list (a decode step sends its one new token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:]
        return self.prompt_token_ids[start:] + self.output_token_ids

    def timings(self, now: float) -> RequestTimings:
        """Queue, prefill and decode time so far (zero for phases never reached, e.g. aborted in queue)."""
        scheduled = self.first_scheduled_time or now
        first = self.first_token_time or now
        return RequestTimings(max(0.0, scheduled - self.arrival_time), max(0.0, first - scheduled),
                              max(0.0, now - first), self.num_preemptions, self.detokenize_s)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all collected yet (a preempted request already has them)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def append_output(self, token_id: int, logprobs: TokenLogprobs) -> None:
        """Record an accepted token; its logprob always counts, its top alternatives only when asked."""
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprobs.logprob
        if self.params.logprobs is not None:
            self.output_logprobs.append(logprobs)


@dataclass
class RequestTimings:
    """Where a finished request's time went, from the engine's own clock (seconds)."""

    queue_s: float  # arrival -> first scheduled
    prefill_s: float  # first scheduled -> first token
    decode_s: float  # first token -> finish
    num_preemptions: int = 0
    detokenize_s: float = 0.0  # part of prefill + decode spent detokenizing


@dataclass
class CompletionDelta:
    """What one completion produced in one engine step: new tokens and text, and whether it ended."""

    request_id: str  # the parent (client-visible) request id
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None  # set on the finished delta
    num_cached_tokens: int = 0  # set on the finished delta: prompt tokens served from the prefix cache
    cumulative_logprob: float | None = None  # set on the finished delta: sum of the sampled tokens' logprobs
    # Set on each completion's first delta when params.prompt_logprobs is set: one entry per prompt
    # token, None for the first (nothing precedes it), then log p(prompt[i] | prompt[:i]) and the top-k.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # a pooling request's vector, on its finished delta
