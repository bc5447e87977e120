"""LLMEngine: the synchronous core. add_request / step / abort; each step is schedule -> run -> update."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace

import torch

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.cache.sizing import blocks_for, gpu_kv_budget, num_kv_blocks
from lmserve.config import EngineConfig
from lmserve.errors import ConfigError
from lmserve.engine.output_processor import OutputProcessor
from lmserve.engine.preflight import check_kv_pool, check_tensor_parallel
from lmserve.engine.tokenizer import Tokenizer
from lmserve.layers.attention_backends import resolve_attention_backend
from lmserve.loader import LoadedModel, load_model, read_model_config, resolve_model_path
from lmserve.loader.sharding import TPShard
from lmserve.lora.registry import LoraRegistry
from lmserve.lora.slots import LoraSlots
from lmserve.request import CompletionDelta, LoraRequest, Request, RequestStatus
from lmserve.sampling_params import SamplingParams, VocabError
from lmserve.sched.scheduler import Scheduler
from lmserve.sched.stop import StopChecker
from lmserve.spec.ngram import NgramProposer
from lmserve.spec.policy import DraftPolicy
from lmserve.spec.stats import SpecDecodeStats
from lmserve.structured.compiler import Compiled, GrammarCompiler, GrammarError, VocabInfo
from lmserve.structured.grammar import Grammar
from lmserve.utils import (auto_dtype_why, available_memory, keep_freed_memory, keeps_gguf, resolve_device, resolve_dtype,
                           resolve_kv_dtype)
from lmserve.worker.executor import MultiprocExecutor, RankProcesses, UniProcExecutor
from lmserve.worker.model_runner import ModelRunner, kv_bytes_per_block, profile_forward

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool, bad token ids...)."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param  # the request field at fault


@dataclass
class StepStats:
    """What one engine step did (read by metrics, benchmarks and tests)."""

    num_running: int = 0
    num_waiting: int = 0
    batch_size: int = 0  # requests in the step's batch
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    step_seconds: float = 0.0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    # speculative decoding in this step: verify runs, drafts, accepted drafts, accepted per draft position
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: list[int] | None = None
    grammar_mask_s: float = 0.0  # filling the step's grammar bitmask (structured outputs), seconds
    # LoRA: adapter names of the running and the waiting requests after the step (None: LoRA off)
    running_loras: tuple[str, ...] | None = None
    waiting_loras: tuple[str, ...] | None = None


class LLMEngine:
    """Owns the model, tokenizer, KV cache, scheduler and runner of one model replica."""

    def __init__(self, cfg: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """Load the model named by cfg, or reuse `loaded` (and `tokenizer`) to build engines of other shapes."""
        self.cfg = cfg
        tp = cfg.parallel.tensor_parallel_size
        if cfg.num_threads or tp > 1:
            torch.set_num_threads(_threads_per_rank(cfg))
        self.device = resolve_device(cfg.device)
        kept_gguf = keeps_gguf(cfg.model, cfg.quantization, self.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device, kept_gguf)
        if cfg.dtype == "auto":
            log.info("--dtype auto: %s (%s)", str(self.dtype).removeprefix("torch."),
                     auto_dtype_why(self.device, kept_gguf=kept_gguf)[1])
        self.ranks = self._start_ranks() if tp > 1 and loaded is None else None
        shard = TPShard(0, tp) if self.ranks is not None else None
        try:
            self._build(loaded, tokenizer, shard)
        except BaseException:  # the worker ranks must not outlive an engine that failed to start
            if self.ranks is not None:
                self.ranks.stop()
            raise
        self.spec = cfg.speculative
        self.proposer = self._proposer()
        self.spec_stats = SpecDecodeStats(self.spec.num_speculative_tokens) if self.spec else None
        self.draft_policy = DraftPolicy()  # draft counts from acceptance and measured step costs
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self._grammars_lock = threading.Lock()
        if self.device.type == "cpu":
            keep_freed_memory()
        self.children: dict[str, list[str]] = {}  # client request id -> its n child request ids
        self.last_step = StepStats(num_free_blocks=self.num_blocks)
        self.num_steps = 0
        self._step_out = None  # the running step's SchedulerOutput, until it has finished: fail_step needs it
        self._step_parents: list[str] = []  # client request ids of the running step's requests
        log.info("KV cache: %d blocks of %d tokens (%s, %.2f GiB%s), max_model_len %d", self.num_blocks,
                 self.block_size, str(self.kv_dtype).removeprefix("torch."), self.num_blocks * self._block_bytes() / 2**30,
                 " per rank" if self.ranks else "", self.max_model_len)

    def _build(self, loaded: LoadedModel | None, tokenizer: Tokenizer | None, shard: TPShard | None) -> None:
        """Load (this rank's part of) the model, then the tokenizer, KV cache, scheduler, runner and executor."""
        cfg = self.cfg
        self.loaded: LoadedModel = loaded or load_model(cfg.model, self.dtype, self.device,
                                                         quantization=cfg.quantization, revision=cfg.revision,
                                                         shard=shard)
        self.dtype = next(self.loaded.model.parameters()).dtype
        self.kv_dtype = self._kv_dtype()
        self.model_config = self.loaded.config
        self.tokenizer = tokenizer or _load_tokenizer(self.loaded)
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.block_size = cfg.cache.block_size
        self.num_blocks = self._num_blocks()
        self.kv = KVCacheManager(self.num_blocks, self.block_size, cfg.cache.enable_prefix_caching)
        self.outputs = OutputProcessor(self.tokenizer)
        self.lora_slots, self.loras = self._lora()
        self.scheduler = Scheduler(cfg.scheduler, self.kv, StopChecker(self.outputs.check_stop_string), self.lora_slots)
        backend = resolve_attention_backend(cfg.attention_backend, self.device, self.dtype)
        # worth a line where there is a choice to see (CUDA, or a backend asked for); the CPU default is quiet
        say = log.info if self.device.type == "cuda" or cfg.attention_backend != "auto" else log.debug
        say("attention backend: %s (%s)", backend.name, backend.why)
        # the runner sees this rank's model: its KV cache holds only this rank's KV heads
        self.runner = ModelRunner(self.loaded.model, self.loaded.model.config, self.num_blocks, self.block_size,
                                  self.dtype, self.device, self.lora_slots, kv_dtype=self.kv_dtype,
                                  attention_backend=backend.name)
        # a captured graph replays fixed weights and inputs: the per-step adapter rows of LoRA are not among them
        if cfg.cuda_graphs and not cfg.enforce_eager and self.device.type == "cuda" and self.lora_slots is None:
            self.runner.enable_decode_graphs(cfg.scheduler.max_num_seqs, blocks_for(self.max_model_len, self.block_size),
                                             capture=True)
        self.executor = self._executor()

    def _lora(self) -> tuple[LoraSlots | None, LoraRegistry | None]:
        """With cfg.lora: wrap the target linears (device slots) and register the adapters named at start."""
        c = self.cfg.lora
        if c is None:
            return None, None
        if self.cfg.parallel.tensor_parallel_size > 1:
            raise ConfigError("--enable-lora does not split adapters across tensor-parallel ranks yet; "
                              "use --tensor-parallel-size 1")
        slots = LoraSlots(self.loaded.model, self.model_config, c.max_loras, c.max_lora_rank, self.dtype, self.device)
        registry = LoraRegistry(c, self.model_config)
        for name, path in c.modules:
            registry.register(name, path)
        log.info("LoRA: %d adapter(s) at start, %d device slots of %.1f MiB (rank up to %d), %d kept in host memory",
                 len(c.modules), c.max_loras, slots.bytes_per_slot / 2**20, c.max_lora_rank, c.max_cpu_loras)
        return slots, registry

    def _kv_dtype(self) -> torch.dtype:
        try:
            return resolve_kv_dtype(self.cfg.cache.kv_cache_dtype, self.dtype, self.loaded.weight_format == "gguf",
                                    self.device)
        except ValueError as e:
            raise ConfigError(f"--kv-cache-dtype: {e}") from None

    def _block_bytes(self) -> int:
        return kv_bytes_per_block(self.loaded.model.config, self.block_size, self.kv_dtype)  # per rank

    def _sizing_block_bytes(self) -> int:
        """What one block costs the memory the pool is sized against: on CPU every rank's share of it comes out
        of the same host memory; on CUDA each rank has its own GPU."""
        ranks = self.cfg.parallel.tensor_parallel_size if self.device.type == "cpu" else 1
        return self._block_bytes() * ranks

    def _start_ranks(self) -> RankProcesses:
        """Check the model splits, then start ranks 1..N-1 (they load their shards while rank 0 loads its own)."""
        check_tensor_parallel(self.cfg.parallel, read_model_config(resolve_model_path(self.cfg.model, self.cfg.revision)),
                              self.device)
        return RankProcesses(self.cfg, self.dtype, self.device, _threads_per_rank(self.cfg))

    def _executor(self) -> UniProcExecutor | MultiprocExecutor:
        if self.ranks is None:
            return UniProcExecutor(self.runner)
        self.ranks.send_pool(self.num_blocks, self.block_size, self.cfg.parallel.rank_timeout_s * 10)
        return MultiprocExecutor(self.runner, self.ranks)

    def close(self) -> None:
        """Stop the executor's worker ranks (nothing to do without tensor parallelism)."""
        self.executor.shutdown()

    def _num_blocks(self) -> int:
        c = self.cfg.cache
        if self.device.type == "cuda" and not c.sized_explicitly:
            c = replace(c, kv_cache_memory=self._profiled_gpu_budget())
        available = available_memory(self.device)
        block_bytes = self._sizing_block_bytes()
        blocks = num_kv_blocks(c, block_bytes, available, self.cfg.scheduler.max_num_seqs, self.max_model_len)
        if not self.cfg.cache.sized_explicitly:  # an explicit size was the user's choice (preflight warned about it)
            check_kv_pool(c, blocks, block_bytes, self.max_model_len, available, explicit=False)
        return max(1, blocks)

    def _profiled_gpu_budget(self) -> int:
        """KV bytes under --gpu-memory-utilization: run one full step's worth of tokens and see what it peaks at."""
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_forward(self.loaded.model, self.cfg.scheduler.max_num_batched_tokens, self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        other = (total - free) - torch.cuda.memory_reserved(self.device)  # CUDA context, other processes
        budget = gpu_kv_budget(total, self.cfg.cache.gpu_memory_utilization,
                               torch.cuda.max_memory_allocated(self.device), other)
        log.info("GPU memory: %.2f GiB total, %.2f GiB peak in this process's steps, %.2f GiB for the KV cache",
                 total / 2**30, torch.cuda.max_memory_allocated(self.device) / 2**30, budget / 2**30)
        return max(budget, 2)  # (kv_cache_memory <= 1 would read as a fraction) no block fits: check_kv_pool says so

    # -- requests ---------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Prompt text -> ids (a raw prompt: "<|im_start|>" in it is the control token); ids are checked and kept."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestRejected("prompt must not be empty")
            return self.tokenizer.encode_prompt(prompt)
        ids = list(prompt)
        if not ids:
            raise RequestRejected("prompt must not be empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestRejected(f"prompt token id {t!r} is out of vocabulary (valid ids are 0..{vocab - 1})")
        return ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Raise RequestRejected when the request could never run; return its resolved max_tokens."""
        try:
            params.check_vocab(self.model_config.vocab_size)
        except VocabError as e:
            raise RequestRejected(str(e), e.param) from None
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestRejected(f"prompt has {n} tokens, the model's context is {self.max_model_len} tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the model's "
                f"context of {self.max_model_len} tokens")
        if self.kv.blocks_needed(n + max_tokens) > self.num_blocks:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs more KV cache than the whole pool "
                f"({self.num_blocks * self.block_size} tokens)")
        if not self.cfg.scheduler.enable_chunked_prefill and n + max_tokens > self.cfg.scheduler.max_num_batched_tokens:
            raise RequestRejected(f"prompt + max_tokens exceeds max_num_batched_tokens "
                                  f"({self.cfg.scheduler.max_num_batched_tokens}) with chunked prefill off")
        return max_tokens

    def compile_grammar(self, params: SamplingParams) -> Compiled | None:
        """The compiled grammar of params.structured_outputs (None without one); blocking, thread-safe.

        The server calls it on a worker thread at admission; the offline path from add_request.
        """
        if params.structured_outputs is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                tok = self.tokenizer
                vocab = VocabInfo(tok.vocab_tokens(), tok.vocab_type, self.model_config.vocab_size,
                                  sorted(self.eos_token_ids))
                self._grammars = GrammarCompiler(vocab, self.cfg.structured)
        try:
            return self._grammars.compile(params.structured_outputs)
        except GrammarError as e:
            raise RequestRejected(f"structured_outputs.{params.structured_outputs.kind}: {e}") from None

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    max_tokens: int | None = None, grammar: Compiled | None = None, tenant: str = "",
                    priority: int = 0, lora: LoraRequest | None = None, cache_salt: bytes = b"") -> None:
        """Queue a request; its `params.n` completions run as separate sequences sharing prompt blocks.

        `max_tokens` is what check_request returned for this prompt and params; None: not checked yet.
        `grammar` is what compile_grammar returned for params; None with structured_outputs: compiled here.
        `tenant` names who asked (the server passes the API key's name): the scheduler is fair between tenants.
        `priority`: waiting requests of a lower value are admitted first (batch lines use BATCH_PRIORITY).
        `lora`: the adapter, already read (LoraRegistry.get, off this thread); None: the base model.
        `cache_salt`: who may share this prompt's prefix-cache blocks (the server's per-key salt); b"": everyone.
        """
        params = params or SamplingParams()
        if lora is not None and self.lora_slots is None:
            raise RequestRejected("this engine runs without LoRA (--enable-lora)", "model")
        if request_id in self.children:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        ids = self.tokenize_prompt(prompt)
        if max_tokens is None:  # the offline path (LLM, the CLI); the server checked before admitting
            max_tokens = self.check_request(ids, params)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.compile_grammar(params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        kids = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i  # completion i draws from seed + i
            req = Request(rid, list(ids), params, max_tokens, stop_ids, parent_id=request_id, index=i, seed=seed,
                          grammar=None if grammar is None else Grammar(grammar.grammar, stop_ids), tenant=tenant,
                          priority=priority, lora=lora,
                          cache_salt=_prefix_salt(lora, cache_salt))
            self.scheduler.add(req)
            self.outputs.add(req)
            kids.append(rid)
        self.children[request_id] = kids

    def abort(self, request_id: str) -> list[CompletionDelta]:
        """Stop a request at any point; its blocks return to the pool at once."""
        deltas = []
        for rid in self.children.pop(request_id, []):
            req = self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                deltas.append(self._final_delta(req))
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[CompletionDelta]:
        """Schedule one batch, run it, and return every completion's new tokens and text."""
        start = time.perf_counter()
        self._step_out, self._step_parents = None, []
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self._step_out = out
        self._step_parents = list(dict.fromkeys(self.scheduler.requests[s.request_id].parent_id for s in out.requests))
        result = self.executor.execute(out)
        changed = self.scheduler.update(out, result)
        spec = self._record_spec(out, result.sampled_token_ids) if self.proposer else None
        deltas = [self._delta(req) for req in changed]
        if spec is not None:
            self._propose()  # drafting is part of the step's time (a draft model runs k forwards here)
        self.num_steps += 1
        self.last_step = StepStats(len(self.scheduler.running), len(self.scheduler.waiting), len(out.requests),
                                   result.num_decodes, result.num_prefill_tokens, time.perf_counter() - start,
                                   self.kv.usage, self.kv.num_free_blocks,
                                   grammar_mask_s=self.scheduler.last_mask_s if out.grammar_bitmask is not None else 0.0)
        if self.lora_slots is not None:
            self.last_step.running_loras, self.last_step.waiting_loras = self.scheduler.lora_names()
        if spec is not None:
            self.draft_policy.record_step(result.num_decodes, self.last_step.step_seconds, result.num_prefill_tokens > 0)
            self.last_step.num_drafts, self.last_step.num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            self.last_step.num_accepted_tokens = spec.num_accepted_tokens
            self.last_step.num_accepted_per_pos = spec.num_accepted_tokens_per_pos
        self._step_out = None
        return deltas

    def fail_step(self) -> list[str]:
        """After step() raised: end the requests of that step, free their blocks; returns their client ids.

        Every prefix hash is forgotten: blocks are published at schedule time, before the forward writes
        their KV, so a failed step may leave published blocks that hold garbage; a later prompt must
        never reuse them (losing the cache is cheap next to a wrong answer). If schedule() itself
        failed, which requests it touched is unknown: all of them fail.
        """
        out, parents = self._step_out, self._step_parents or list(self.children)
        self._step_out, self._step_parents = None, []
        if out is not None:
            self.scheduler.resend_finished(out.finished_ids)  # the failed step may not have dropped their rows
        for parent in parents:
            for rid in self.children.pop(parent, []):
                self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)  # frees its blocks (if still held)
                self._forget(rid)  # also when it finished inside the failed update() and was never closed
        self.kv.reset_prefix_cache()
        return parents

    # -- speculative decoding ---------------------------------------------------------------------

    def _proposer(self):
        """The draft source named by the speculative config (None: speculation off)."""
        if self.spec is None:
            return None
        if self.spec.method == "ngram":
            return NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        from lmserve.engine.draft import DraftModelProposer  # noqa: PLC0415 - only when asked

        # the draft follows --quantization as the target does (auto: the draft file's own blocks where they run)
        draft = load_model(self.spec.model, self.dtype, self.device, quantization=self.cfg.quantization)
        _check_same_tokenizer(self, draft)
        # and --kv-cache-dtype (auto: float16 for its kept blocks, as the target's)
        kv_dtype = resolve_kv_dtype(self.cfg.cache.kv_cache_dtype, next(draft.model.parameters()).dtype,
                                    draft.weight_format == "gguf", self.device)
        return DraftModelProposer(self.spec, draft, self.num_blocks, self.block_size, kv_dtype)

    def _record_spec(self, out, sampled: list[list[int]]) -> SpecDecodeStats:
        """Count each verify run's accepted drafts (engine totals, this step, the draft policy)."""
        step = SpecDecodeStats(self.spec.num_speculative_tokens)
        for s, tokens in zip(out.requests, sampled):
            if s.spec_token_ids:
                accepted = max(len(tokens) - 1, 0)
                for stats in (step, self.spec_stats):
                    stats.record(len(s.spec_token_ids), accepted)
                self.draft_policy.record_run(s.request_id, len(s.spec_token_ids), accepted)
        return step

    def _propose(self) -> None:
        """Give every caught-up running request the drafts the policy finds worth their verify rows."""
        k = self.spec.num_speculative_tokens
        decoding = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]  # not prefilling
        # the verify step adds one token of its own, so a request can take max_tokens - output - 1 drafts
        rooms = [(r, min(k, r.max_tokens - len(r.output_token_ids) - 1)) for r in decoding]
        reqs, limits = [r for r, n in rooms if n > 0], [n for _, n in rooms if n > 0]
        seeded = [r.seed is not None and not r.params.greedy for r in reqs]  # their tokens must not vary
        counts = self.draft_policy.plan([r.request_id for r in reqs], limits, len(decoding), seeded)
        reqs, limits = [r for r, n in zip(reqs, counts) if n], [n for n in counts if n]
        if reqs:
            for req, drafts in zip(reqs, self.proposer.propose(reqs, limits)):
                if req.grammar is not None:  # drafts the grammar refuses would only be rejected
                    drafts = drafts[:req.grammar.valid_prefix(drafts)]
                req.spec_token_ids = drafts

    def _delta(self, req: Request) -> CompletionDelta:
        delta = self.outputs.process(req)
        if req.status.finished:
            self._close(req, delta)
        return delta

    def _final_delta(self, req: Request) -> CompletionDelta:
        delta = CompletionDelta(req.parent_id or req.request_id, req.index, [], "", None,
                                num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids))
        self._close(req, delta)
        return delta

    def _close(self, req: Request, delta: CompletionDelta) -> None:
        delta.finished = True
        delta.finish_reason = req.status.value
        delta.stop_reason = req.stop_reason
        delta.timings = req.timings(time.monotonic())
        delta.cumulative_logprob = req.cumulative_logprob
        delta.num_cached_tokens = req.num_cached_tokens
        self._forget(req.request_id)
        kids = self.children.get(req.parent_id)
        if kids is not None and all(k not in self.scheduler.requests for k in kids):
            del self.children[req.parent_id]

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's per-request state outside the scheduler (detokenizer, drafts)."""
        self.outputs.remove(request_id)
        if self.proposer is not None:
            self.draft_policy.remove(request_id)
            self.proposer.remove(request_id)


def _prefix_salt(lora: LoraRequest | None, salt: bytes) -> bytes:
    """The adapter's registration first (blocks never cross adapters), then the caller's salt after a NUL: the
    adapter part holds no NUL, so no two (adapter, salt) pairs give the same bytes."""
    adapter = b"" if lora is None else b"lora:%d" % lora.lora_int_id
    return adapter + b"\0" + salt if salt else adapter


def _threads_per_rank(cfg: EngineConfig) -> int:
    """--num-threads, else the cores shared out between the ranks (2 cores, TP=2: one thread each)."""
    if cfg.num_threads:
        return cfg.num_threads
    return max(1, len(os.sched_getaffinity(0)) // cfg.parallel.tensor_parallel_size)


def _load_tokenizer(loaded: LoadedModel) -> Tokenizer:
    if loaded.format == "gguf":
        return Tokenizer.from_gguf(loaded.path, loaded.gguf.metadata if loaded.gguf else None)
    return Tokenizer.from_pretrained(loaded.path)


def _check_same_tokenizer(target: LLMEngine, draft: LoadedModel) -> None:
    """Refuse a draft model whose vocabulary differs from the target's: its ids would mean other text."""
    tok = _load_tokenizer(draft)
    probe = "Speculative decoding needs one vocabulary: <|im_start|> 123 ünïcödé\n\tend."
    same = (draft.config.vocab_size == target.model_config.vocab_size
            and tok.encode(probe) == target.tokenizer.encode(probe)
            and tok.vocab_size == target.tokenizer.vocab_size
            and all(tok.id_to_piece(i) == target.tokenizer.id_to_piece(i) for i in range(tok.vocab_size)))
    if not same:
        raise ValueError(f"draft model {draft.path} does not share the target model's tokenizer "
                         "(vocabularies differ); speculative decoding needs the same token ids")
