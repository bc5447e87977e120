"""Draft-model speculation: a second model drafts k tokens per request, batched across requests, over
its own paged KV cache. It lives beside the engine because it is a small engine of its own (a KV cache
manager and a model runner), driven by the real one between steps.

Each round first catches the draft cache up with the tokens the target accepted since the last round
(the whole prompt the first time), then runs k - 1 more single-token steps; every step is one batched
forward of all drafting requests. Drafts are the draft model's argmax: a deterministic q, for which the
rejection sampler keeps the target's distribution exact (sampled requests accept a draft with
probability p(draft)); greedy requests are then token-for-token what the target alone would emit.
After verification, draft KV past the accepted prefix is rolled back (its blocks trimmed) lazily, at
the start of the request's next round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.config import SpeculativeConfig
from lmserve.loader import LoadedModel
from lmserve.sampling_params import SamplingParams
from lmserve.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.transforms import TransformContext

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class _Draft:
    """One request's state in the draft cache."""

    num_computed: int = 0  # leading tokens of the request whose KV the draft cache holds
    num_blocks_sent: int = 0  # leading block ids of its draft-cache table the draft runner's row holds


class DraftModelProposer:
    """Proposes drafts with a small model sharing the target's tokenizer."""

    def __init__(self, spec: SpeculativeConfig, loaded: LoadedModel, transforms: TransformContext, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype | None = None) -> None:
        """`loaded` is the draft model, already checked by the engine to share the target's tokenizer, and
        `transforms` what the transform pipeline handed on over it; `kv_dtype`: its KV cache's (None: its
        parameters' dtype)."""
        self.loaded = loaded
        param = next(loaded.model.parameters())
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(loaded.model, loaded.config, num_blocks, block_size, param.dtype, param.device,
                                  transforms, kv_dtype=kv_dtype)
        self.state: dict[str, _Draft] = {}
        self._new: list[NewRequestData] = []
        self._finished: list[str] = []
        log.info("draft model %s loaded for speculative decoding (%d tokens per step)", spec.model,
                 spec.num_speculative_tokens)

    def propose(self, reqs: list, limits: list[int]) -> list[list[int]]:
        """Up to limits[i] greedy draft tokens for each request (a `Request` that has caught up)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        for req in reqs:
            self._roll_back(req)
        active = list(range(len(reqs)))
        for step in range(max(limits, default=0)):
            out, active = self._step_output(reqs, drafts, [i for i in active if limits[i] > step], step == 0)
            if not active:
                break
            result = self.runner.execute(out)
            for j, i in enumerate(active):
                drafts[i].append(result.sampled_token_ids[j][0])
        return drafts

    def remove(self, request_id: str) -> None:
        """Forget a finished request: free its draft blocks and, at the next step, its sampling row."""
        if self.state.pop(request_id, None) is not None:
            self.kv.free(request_id)
            self._finished.append(request_id)

    def _roll_back(self, req) -> None:
        """Keep only the draft KV of tokens the target accepted (drafts after a rejection are stale)."""
        st = self.state.get(req.request_id)
        if st is None:
            st = self.state[req.request_id] = _Draft()
            self._new.append(NewRequestData(req.request_id, req.prompt_token_ids, [], _GREEDY, frozenset(), None))
        st.num_computed = min(st.num_computed, req.num_tokens - 1)
        self.kv.trim(req.request_id, st.num_computed)
        st.num_blocks_sent = min(st.num_blocks_sent, self.kv.num_blocks_of(req.request_id))

    def _step_output(self, reqs: list, drafts: list[list[int]], active: list[int], first: bool
                     ) -> tuple[SchedulerOutput, list[int]]:
        """One draft step over reqs[i] for i in active: the catch-up tokens (first step) or the last draft.

        A request whose draft blocks run out stops drafting this round (the target goes on without).
        """
        out = SchedulerOutput(new_requests=self._new, finished_ids=self._finished)
        self._new, self._finished = [], []
        kept = []
        for i in active:
            req, st = reqs[i], self.state[reqs[i].request_id]
            tokens = req.token_ids_from(st.num_computed) if first else drafts[i][-1:]
            if not self.kv.allocate(req.request_id, req.all_token_ids + drafts[i], st.num_computed, len(tokens)):
                continue
            # the runner's row gets the tokens it computes (written at their positions) and its new block ids
            rid, sent = req.request_id, st.num_blocks_sent
            st.num_blocks_sent = self.kv.num_blocks_of(rid)
            out.requests.append(ScheduledRequest(rid, st.num_computed, len(tokens), True, list(tokens), st.num_computed,
                                                 self.kv.block_ids(rid, sent), sent))
            st.num_computed += len(tokens)
            kept.append(i)
        return out, kept
