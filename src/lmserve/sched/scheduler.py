"""Continuous batching with no prefill/decode phases: each running request's `num_computed_tokens`
catches up to its `num_tokens` within a per-step token budget (this gives chunked prefill), waiting
requests join while slots and blocks last, and the newest running request is preempted (blocks freed,
recomputed later) when the KV cache runs out. Waiting requests of a lower `priority` join first (batch-job
lines wait behind interactive requests), then FCFS, or round-robin between tenants (API key names), and a
tenant holding every slot gives one up to a waiting tenant (sched/fairness.py). The budget is shared fairly
between tenants by tokens, short demands first (sched/budget.py): a long prefill takes what is left, in
chunks, so a short request never waits for it to end. A chunk that starts at an image span whose tokens attend
both ways (Gemma 3) gets the span's whole rest first, within the budget (`_grants`, `whole_spans`).

With LoRA, a waiting request is admitted only when its adapter has or can get one of the `max_loras`
device slots this step (lora/slots.py); one that cannot waits, keeping its place, while others go ahead.
A slot is only taken from an adapter that no running request uses.

A request that has caught up may carry draft tokens (`spec_token_ids`, set by a proposer): they run
after its last known token in the same step, and `update` keeps the accepted prefix of them plus the
one token the verifier sampled, then trims the KV blocks that only rejected drafts used.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Protocol

from lmserve.cache.kv_cache_manager import ComputedBlocks, KVCacheManager
from lmserve.config import SchedulerConfig
from lmserve.request import LoRARequest, Request, RequestStatus, TokenLogprobs
from lmserve.sched.budget import Demand, StepBudget, split_budget
from lmserve.sched.fairness import admission_order, fair_victim
from lmserve.sched.output import KVTransfers, NewRequestData, ScheduledRequest, SchedulerOutput
from lmserve.sched.stop import StopChecker
from lmserve.structured.grammar import fill_bitmask

log = logging.getLogger(__name__)


class StepResult(Protocol):
    """What update() reads from a step (the runner's output): per scheduled request, in schedule order."""

    sampled_token_ids: list[list[int]]  # accepted drafts then the newly sampled token; [] when none
    logprobs: list[list[TokenLogprobs]]  # one per sampled token
    prompt_logprobs: dict[str, list[TokenLogprobs]]  # prompt logprobs computed this step
    embeddings: dict[str, list[float]]  # pooling requests whose prompt ended this step: their vectors


@dataclass(frozen=True)
class Joining:
    """A waiting request that may join this step, and the tokens it would compute (those the prefix cache lacks)."""

    req: Request
    num_new_tokens: int


class AdapterSlots(Protocol):
    """The device slots of LoRA adapters (lora/slots.LoraSlots), as the scheduler uses them."""

    def acquire(self, lora: LoRARequest, busy: set[int]) -> bool: ...

    def slot_of(self, lora: LoRARequest | None) -> int: ...


class Scheduler:
    """Decides every step which requests run how many tokens, and applies what the step produced."""

    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, stop: StopChecker | None = None,
                 lora: AdapterSlots | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.stop = stop or StopChecker()
        self.lora = lora  # None: LoRA off
        # requests the runner has a row for -> [token ids, block ids] of the request its row holds: a step sends
        # only the rest (a preempted request's blocks were freed: its table is sent again from 0 when it resumes)
        self._sent: dict[str, list[int]] = {}
        self._finished: list[str] = []  # ended since the last schedule(): the runner drops their rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.last_mask_s = 0.0  # time the last grammar bitmask took to fill
        self._tenants: set[str] = set()  # every tenant seen; with one, nobody is preempted to make room
        self.budget = StepBudget(cfg)  # tokens of every step: max_num_batched_tokens, or fitted to the host
        self._last_admitted: dict[str, int] = {}  # tenant -> number of the admission it last got (round-robin)
        self._num_admitted = 0

    def add(self, req: Request) -> None:
        """Queue a request (the engine has already checked that it can ever fit)."""
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self._tenants.add(req.tenant)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Build one step's batch: running requests first (in admission order), then waiting ones, each with the
        tokens the step's budget gives it (sched/budget.py: fair between tenants, short demands first)."""
        out = SchedulerOutput(finished_ids=self._finished)
        self._finished = []
        self._make_room_for_tenant(out)
        num_fair_preempted = len(out.preempted_ids)
        joining = self._joining()
        grants = self._grants(joining)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            i += 1
            if grants.get(req.request_id, 0) > 0 and not self._schedule_running(req, grants[req.request_id], out):
                break  # req itself was preempted: everything after it already was
        if len(out.preempted_ids) == num_fair_preempted:  # out of KV blocks: admitting would only preempt again
            self._admit(out, joining, grants)
        self._grammar_rows(out)
        copies = self.kv.take_transfers()
        out.kv_transfers = KVTransfers(*copies) if copies is not None else None
        return out

    def _grants(self, joining: list[Joining]) -> dict[str, int]:
        """request id -> tokens this step: the budget split fairly (sched/budget.py), after the image spans.

        A request whose next chunk starts at (or, after a prefix-cache hit, inside) a bidirectional image span must
        run the span's rest in one step (whole_spans). Such spans are granted first, in schedule order, while they
        fit in what is left of the budget; one that does not fit waits for a later step (the first span of a step
        always fits), and the rest is split as usual. A span longer than the whole budget could never fit: its request runs
        alone for one step (vLLM's rule; a fitted budget can shrink below an image, engine/step_budget.py). So a
        step never holds more than the budget, except that one request alone.
        """
        demands = self._demands(joining)
        if not self.cfg.enable_chunked_prefill:  # whole prompts only: a chunk never ends inside a span
            return split_budget(self.budget.tokens, demands, False)
        starts = [(r, r.num_computed_tokens) for r in self.running]
        starts += [(j.req, j.req.num_tokens - j.num_new_tokens) for j in joining]
        left, spans = self.budget.tokens, {}
        for req, start in starts:
            need = span_rest(req.mm_inputs, start)
            if need == 0:
                continue
            if need > self.budget.tokens and not spans:
                return {req.request_id: need}  # could never fit: alone (no span comes before it this step)
            spans[req.request_id] = need if need <= left else 0  # 0: waits for the next step
            left -= spans[req.request_id]
        return {**split_budget(left, [d for d in demands if d.request_id not in spans]), **spans}

    def _demands(self, joining: list[Joining]) -> list[Demand]:
        """What each running request (its known tokens and drafts) and each joining one (its uncached prompt) wants."""
        running = [Demand(r.request_id, r.tenant, r.num_tokens - r.num_computed_tokens + len(r.spec_token_ids))
                   for r in self.running]
        return running + [Demand(j.req.request_id, j.req.tenant, j.num_new_tokens) for j in joining]

    def _schedule_running(self, req: Request, grant: int, out: SchedulerOutput) -> bool:
        """Schedule up to `grant` tokens of a running request, known ones before drafts; False: req was preempted."""
        known = req.num_tokens - req.num_computed_tokens
        n = whole_spans(req.mm_inputs, req.num_computed_tokens, min(known, grant))
        if n == 0:
            return True  # its chunk would end inside an image span: it waits for a step with room for the span
        spec = req.spec_token_ids[:grant - n] if n == known else []
        if spec and not self.kv.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, n,
                                         extra=req.prefix_salt, num_lookahead=len(spec)):
            spec = []  # drafts are optional: drop them before preempting anyone for their blocks
        if not spec and not self._allocate_or_preempt(req, n, out):
            return False
        out.requests.append(self._scheduled(req, n, spec))
        return True

    def _grammar_rows(self, out: SchedulerOutput) -> None:
        """Fill the step's bitmask: one row per logits row of each constrained request that samples (a grammar, or a
        reasoning budget: its end tag forced, its stop tokens masked until the answer begins)."""
        items, row, width = [], 0, None
        for s in out.requests:
            req = self.requests[s.request_id]
            grammar, budget = req.grammar, req.reasoning_budget
            if budget is not None and budget.active and s.sample:
                forced, s.stop_ban_rows = budget.rows(s.spec_token_ids)
                budget = budget if forced else None  # a bitmask row only to force; stop bans go to the sampler
            else:
                budget = None
            if s.sample and (grammar is not None or budget is not None):
                s.grammar_row = row
                items.append((grammar, s.spec_token_ids, req.max_tokens - len(req.output_token_ids), budget))
                width = width if budget is None else budget.vocab_size
                row += 1 + len(s.spec_token_ids)
        if items:
            start = time.perf_counter()
            out.grammar_bitmask = fill_bitmask(items, width)
            self.last_mask_s = time.perf_counter() - start

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, n,
                                   extra=req.prefix_salt):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _make_room_for_tenant(self, out: SchedulerOutput) -> None:
        """All slots taken and the next waiting tenant holds two fewer than the busiest: preempt the busiest's newest.

        Runs before the running requests are scheduled, so the victim is not in this step's batch.
        """
        if len(self._tenants) <= 1 or not self.waiting or len(self.running) < self.cfg.max_num_seqs:
            return
        victim = fair_victim(next(admission_order(self.waiting, self._last_admitted)), self.running)
        if victim is not None:
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)

    def _joining(self) -> list[Joining]:
        """The waiting requests that may join this step, in admission order, with their prefix-cache hits.

        At most the free slots; a request whose adapter can get no device slot waits, keeping its place; a
        tenant's requests only until their tokens fill a step's budget (the ones after could get none).
        """
        free = self.cfg.max_num_seqs - len(self.running)
        if free <= 0 or not self.waiting:
            return []
        joining: list[Joining] = []
        wanted: Counter[str] = Counter()
        tenants = {r.tenant for r in self.waiting}
        busy = self._busy_adapters()  # and the joining requests': a slot one of them got is not taken back
        for req in admission_order(self.waiting, self._last_admitted):
            if len(joining) == free or not tenants:
                break
            if req.tenant not in tenants or (req.lora is not None and not self.lora.acquire(req.lora, busy)):
                continue
            if req.lora is not None:
                busy.add(req.lora.lora_int_id)
            joining.append(Joining(req, req.num_tokens - self._prefix_hit(req).num_tokens))
            wanted[req.tenant] += joining[-1].num_new_tokens
            if wanted[req.tenant] >= self.budget.tokens:
                tenants.discard(req.tenant)
        return joining

    def _admit(self, out: SchedulerOutput, joining: list[Joining], grants: dict[str, int]) -> None:
        """Start the joining requests the budget gave tokens, in admission order, until KV blocks run out."""
        for j in joining:
            req, grant = j.req, grants.get(j.req.request_id, 0)
            if grant == 0:
                continue
            # looked up again: this step's allocations may have evicted cached blocks, or published new ones
            computed = self._prefix_hit(req)
            n = whole_spans(req.mm_inputs, computed.num_tokens, min(grant, req.num_tokens - computed.num_tokens))
            if n < req.num_tokens - computed.num_tokens and not self.cfg.enable_chunked_prefill:
                break  # whole prompts only, and this one does not fit: FCFS, nobody overtakes it
            if n == 0:
                continue  # its chunk would end inside an image span (the prefix hit moved): it waits
            if not self.kv.allocate(req.request_id, req.all_token_ids, computed.num_tokens, n, computed,
                                    req.prefix_salt):
                break
            self._start(req, computed.num_tokens, out)
            out.requests.append(self._scheduled(req, n, []))

    def _prefix_hit(self, req: Request) -> ComputedBlocks:
        """The blocks of req's tokens the prefix cache holds (none when it needs every position's logits)."""
        return self.kv.find_computed(req.request_id, req.all_token_ids, req.prefix_salt,
                                     allow=not req.wants_prompt_logprobs and req.may_reuse_prefix)

    def _start(self, req: Request, num_cached: int, out: SchedulerOutput) -> None:
        """Move an admitted request from the queue to the running batch; a new one's row goes out whole."""
        self.waiting.remove(req)
        self._num_admitted += 1
        self._last_admitted[req.tenant] = self._num_admitted
        req.num_computed_tokens = num_cached
        req.num_cached_tokens += num_cached
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)
        if req.request_id not in self._sent:
            self._sent[req.request_id] = [req.num_tokens, 0]
            out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                                                   req.params, req.stop_token_ids, req.seed, req.mm_inputs))

    def _busy_adapters(self) -> set[int]:
        """lora_int_ids of the running requests' adapters: their slots must not be reassigned."""
        return {r.lora.lora_int_id for r in self.running if r.lora is not None}

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Adapter names of the running and of the waiting requests (vLLM's lora_requests_info labels)."""
        running = dict.fromkeys(r.lora.name for r in self.running if r.lora is not None)
        waiting = dict.fromkeys(r.lora.name for r in self.waiting if r.lora is not None)
        return tuple(running), tuple(waiting)

    def _scheduled(self, req: Request, n: int, spec: list[int]) -> ScheduledRequest:
        """`n` known tokens and the drafts `spec` of `req` (its blocks allocated), with what its row lacks."""
        start = req.num_computed_tokens
        lp_range = None
        if req.wants_prompt_logprobs:  # positions p whose logits score prompt token p + 1
            first = max(start, len(req.prompt_logprobs))
            lp_range = (first, min(start + n, req.num_prompt_tokens - 1))
        sent = self._sent[req.request_id]
        token_start, block_start = sent
        sent[0], sent[1] = req.num_tokens, self.kv.num_blocks_of(req.request_id)
        return ScheduledRequest(req.request_id, start, n, start + n == req.num_tokens,
                                req.token_ids_from(token_start), token_start,
                                self.kv.table_ids(req.request_id, block_start), block_start, list(spec),
                                prompt_logprob_range=lp_range,
                                lora_slot=self.lora.slot_of(req.lora) if req.lora is not None else -1,
                                pool=req.params.pooling is not None)

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it at the front of the queue to recompute later."""
        self.kv.free(req.request_id)
        self._sent[req.request_id][1] = 0  # its row's table starts over when it resumes
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Advance computed counts, append accepted tokens one by one through the stop checker, trim KV.

        Returns the requests that received a token this step (finished ones included).
        """
        changed = []
        now = time.monotonic()
        for i, s in enumerate(out.requests):
            req = self.requests.get(s.request_id)
            if req is None or req.status.finished:
                continue
            tokens = result.sampled_token_ids[i]
            # every known token's KV is written; of the drafts, those accepted (all sampled tokens but the last)
            req.num_computed_tokens += s.num_known + max(len(tokens) - 1, 0)
            req.spec_token_ids = []
            if s.prompt_logprob_range is not None:
                req.prompt_logprobs.extend(result.prompt_logprobs.get(s.request_id, ()))
            if s.pool and s.sample:  # its prompt has run: no decode follows, its blocks go back now
                req.embedding = result.embeddings[s.request_id]
                self.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                changed.append(req)
                continue
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            self._accept(req, tokens, result.logprobs[i])
            if not req.status.finished and s.spec_token_ids:
                self.kv.trim(req.request_id, req.num_tokens)  # blocks only rejected drafts reached
                sent = self._sent[req.request_id]  # the runner's table is cut there: its next blocks may differ
                sent[1] = min(sent[1], self.kv.num_blocks_of(req.request_id))
            changed.append(req)
        return changed

    def _accept(self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs]) -> None:
        """Append tokens until one stops the request; the rest of a speculative run is dropped."""
        for token, lp in zip(tokens, logprobs):
            if req.reasoning_budget is not None:
                req.reasoning_budget.accept(token)
            if req.grammar is not None and not req.grammar.accept(token):
                # the mask allows only tokens the grammar accepts, so this is a bug; end the request, not the engine
                log.error("request %s: grammar refused sampled token %d; aborting it", req.request_id, token)
                self.finish(req.request_id, RequestStatus.FINISHED_ABORTED)
                return
            req.append_output(token, lp)
            status = self.stop.check(req, token)
            if status is not None:
                self.finish(req.request_id, status)
                return

    def resend_finished(self, request_ids: list[str]) -> None:
        """Tell the runner again to drop these rows: the step that carried them failed (unknown ids are ignored)."""
        self._finished.extend(request_ids)

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
        if self._sent.pop(request_id, None) is not None:
            self._finished.append(request_id)
        return req


def span_rest(images: tuple, start: int) -> int:
    """Tokens from `start` to the end of the bidirectional image span that `start` is at or inside (0: none): the
    least a chunk from `start` may hold, since the span's queries need all of its keys."""
    for mm in images:
        if getattr(mm, "bidirectional", False):
            a, b = mm.span
            if a <= start < b:
                return b - start
    return 0


def whole_spans(images: tuple, start: int, n: int) -> int:
    """At most `n` tokens from `start`, cut so the chunk never ends inside an image whose tokens attend both ways
    (MMInput.bidirectional, Gemma 3): back to the span's start, or to 0 where the chunk begins at or inside it
    (the request waits: Scheduler._grants gives such a span its whole rest in some step)."""
    for mm in images:
        if not getattr(mm, "bidirectional", False):
            continue
        a, b = mm.span
        if a < start + n < b:
            n = max(a - start, 0)
    return n
