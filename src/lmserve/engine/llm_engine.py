"""LLMEngine: the synchronous core of one model replica. Each step is schedule -> execute -> update -> propose.

The parts come from engine/build.py (model, KV pool, runner, executor), requests arrive checked and built by
the front end (engine/front.py), and drafts come from engine/speculate.py; what is left here is the loop.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from lmserve.config import EngineConfig
from lmserve.engine.build import build_engine
from lmserve.engine.front import EngineFront
from lmserve.engine.kv_offload import attach_kv_tier
from lmserve.engine.output_processor import OutputProcessor
from lmserve.engine.speculate import Speculator
from lmserve.engine.stats import StepStats, engine_load, step_stats
from lmserve.errors import RequestRejected
from lmserve.loader import LoadedModel
from lmserve.request import CompletionDelta, EngineRequest, Request, RequestStatus
from lmserve.sampling_params import SamplingParams
from lmserve.sched.scheduler import Scheduler
from lmserve.sched.stop import StopChecker
from lmserve.tokenizer import Tokenizer

__all__ = ["LLMEngine", "RequestRejected", "StepStats"]


class LLMEngine:
    """Runs the steps of one model replica: its scheduler, runner (through the executor) and output processor."""

    def __init__(self, cfg: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """Load the model named by cfg, or reuse `loaded` (and `tokenizer`) to build engines of other shapes."""
        p = build_engine(cfg, loaded, tokenizer)
        cfg = p.cfg  # an encoder's: its prompts run whole (engine/build.py)
        self.cfg, self.loaded, self.tokenizer, self.model_config = cfg, p.loaded, p.tokenizer, p.loaded.config
        self.dtype, self.kv_dtype, self.max_model_len, self.eos_token_ids = p.dtype, p.kv_dtype, p.max_model_len, \
            p.eos_token_ids
        self.num_blocks, self.block_size, self.block_bytes, self.kv = p.num_blocks, p.block_size, p.block_bytes, p.kv
        self.lora_slots, self.loras, self.runner, self.executor = p.lora_slots, p.loras, p.runner, p.executor
        self.kv_tier = attach_kv_tier(p)  # host memory and disk below the pool (None: off)
        self.outputs = OutputProcessor(p.tokenizer)
        self.scheduler = Scheduler(cfg.scheduler, p.kv, StopChecker(self.outputs.check_stop_string), p.lora_slots)
        self.front = EngineFront(p, partial(engine_load, self.scheduler, p.kv, p.runner))
        self.speculator = Speculator(cfg.speculative, p.proposer) if p.proposer is not None else None
        self.spec_stats = self.speculator.stats if self.speculator is not None else None
        self.children: dict[str, list[str]] = {}  # client request id -> its n child request ids
        self.last_step = StepStats(num_free_blocks=self.num_blocks)
        self.num_steps = 0
        self._step_out = None  # the running step's SchedulerOutput, until it has finished: fail_step needs it
        self._step_parents: list[str] = []  # client request ids of the running step's requests

    def close(self) -> None:
        """Stop the executor's worker ranks (nothing to do without tensor parallelism); finish the KV tier's writes."""
        self.executor.shutdown()
        if self.kv_tier is not None:
            self.kv_tier.close()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    **fields: Any) -> None:
        """Queue a request built from its id, prompt, params and `fields` (EngineRequest's other fields, by name)."""
        self.add(EngineRequest(request_id, prompt, params or SamplingParams(), **fields))

    def add(self, request: EngineRequest) -> None:
        """Queue a request; its `params.n` completions run as separate sequences sharing prompt blocks."""
        if request.request_id in self.children:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        reqs = self.front.requests(request)
        for req in reqs:
            self.scheduler.add(req)
            self.outputs.add(req)
        self.children[request.request_id] = [req.request_id for req in reqs]

    def abort(self, request_id: str) -> list[CompletionDelta]:
        """Stop a request at any point; its blocks return to the pool at once."""
        deltas = []
        for rid in self.children.pop(request_id, []):
            req = self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                deltas.append(self._final_delta(req))
        return deltas

    def has_unfinished(self) -> bool:
        """Some request is waiting or running."""
        return self.scheduler.has_unfinished()

    def progress(self) -> int:
        """Decoder layers run since start: grows while a step makes progress (read by the hung-step watchdog)."""
        return self.runner.progress.count

    def step(self) -> list[CompletionDelta]:
        """Schedule one batch, run it, apply its tokens, propose drafts; returns every completion's new tokens."""
        start = time.perf_counter()
        self._step_out, self._step_parents = None, []
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self._step_out = out
        self._step_parents = list(dict.fromkeys(self.scheduler.requests[s.request_id].parent_id for s in out.requests))
        self.runner.gate.begin_step()  # on a CPU, waits (bounded) while another model's short encoder step runs
        result = self.executor.execute(out)
        changed = self.scheduler.update(out, result)
        spec = self.speculator.record(out, result.sampled_token_ids) if self.speculator is not None else None
        deltas = [self._delta(req) for req in changed]
        if spec is not None:
            self.speculator.propose(self.scheduler.running)  # drafting is part of the step's time
        self.num_steps += 1
        seconds = time.perf_counter() - start
        busy = seconds - self.runner.gate.end_step()  # the host's speed is what the step computed, not what it waited
        self.scheduler.budget.observe(busy, result.num_prefill_tokens)  # a served engine's budget follows the host
        self.last_step = step_stats(self.scheduler, self.kv, out, result.num_decodes, result.num_prefill_tokens,
                                    seconds, spec, self.lora_slots is not None)
        if spec is not None:
            self.speculator.record_step(result.num_decodes, busy, result.num_prefill_tokens > 0)
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
        self.runner.gate.end_step()  # the failed step's allowance ends with it (its wait still counts as paused)
        if out is not None:
            self.scheduler.resend_finished(out.finished_ids)  # the failed step may not have dropped their rows
        for parent in parents:
            for rid in self.children.pop(parent, []):
                self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)  # frees its blocks (if still held)
                self._forget(rid)  # also when it finished inside the failed update() and was never closed
        self.kv.reset_prefix_cache()
        return parents

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
        delta.finished, delta.finish_reason, delta.stop_reason = True, req.status.value, req.stop_reason
        delta.timings, delta.cumulative_logprob = req.timings(time.monotonic()), req.cumulative_logprob
        delta.num_cached_tokens = req.num_cached_tokens
        delta.embedding = req.embedding
        self._forget(req.request_id)
        kids = self.children.get(req.parent_id)
        if kids is not None and all(k not in self.scheduler.requests for k in kids):
            del self.children[req.parent_id]

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's per-request state outside the scheduler (detokenizer, drafts)."""
        self.outputs.remove(request_id)
        if self.speculator is not None:
            self.speculator.remove(request_id)
