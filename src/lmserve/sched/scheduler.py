"""Continuous batching with no prefill/decode phases: each running request's `num_computed_tokens`
catches up to its `num_tokens` within a per-step token budget (this gives chunked prefill), waiting
requests join FCFS while blocks and slots last, and the newest running request is preempted
(blocks freed, recomputed later) when the KV cache runs out.
"""

from __future__ import annotations

import time
from collections import deque

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.config import SchedulerConfig
from lmserve.request import Request, RequestStatus, TokenLogprobs
from lmserve.sched.output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Decides every step which requests run how many tokens, and applies what the step produced."""

    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager) -> None:
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        """Queue a request (the engine has already checked that it can ever fit)."""
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Build one step's batch: running requests first (in admission order), then waiting ones."""
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted: everything after it already was
            out.requests.append(self._scheduled(req, n))
            budget -= n
            i += 1
        if not out.preempted_ids:  # admitting now would only be preempted again
            budget = self._admit(out, budget)
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, n,
                                   extra=req.cache_salt):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            computed = self.kv.find_computed(req.request_id, tokens, req.cache_salt)
            n = len(tokens) - computed.num_tokens
            if n > budget:
                if not self.cfg.enable_chunked_prefill:
                    break
                n = budget
            if not self.kv.allocate(req.request_id, tokens, computed.num_tokens, n, computed, req.cache_salt):
                break
            self.waiting.popleft()
            req.num_computed_tokens = computed.num_tokens
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.requests.append(self._scheduled(req, n))
            budget -= n
        return budget

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + n]
        return ScheduledRequest(req.request_id, tokens, start, self.kv.block_ids(req.request_id),
                                sample=start + n == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it at the front of the queue to recompute later."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, tuple[int, TokenLogprobs | None]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a stop or limit.

        Returns the requests that received a token this step (finished ones included).
        """
        changed = []
        now = time.monotonic()
        for s in out.requests:
            req = self.requests.get(s.request_id)
            if req is None or req.status.finished:
                continue
            req.num_computed_tokens += s.num_tokens
            if s.request_id not in sampled:
                continue
            token, logprobs = sampled[s.request_id]
            req.append_output(token, logprobs)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._check_stop(req, token)
            if status is not None:
                self.finish(req.request_id, status)
            changed.append(req)
        return changed

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        n_out = len(req.output_token_ids)
        if n_out >= req.params.min_tokens and token in req.stop_token_ids:
            req.stop_reason = None if token not in req.params.stop_token_ids else token
            return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop, length or abort) at any point and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(request_id)
        return req
