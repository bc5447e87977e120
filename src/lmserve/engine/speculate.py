"""Speculative decoding around the step: count what each verify run accepted, then give every caught-up request
the drafts the policy finds worth their verify rows (spec/policy.py), from the configured proposer.

`make_proposer` builds the draft source at start: prompt lookup (spec/ngram.py) or a draft model
(engine/draft.py) that must share the target's tokenizer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmserve.config import EngineConfig, SpeculativeConfig
from lmserve.loader import LoadedModel, load_model
from lmserve.request import Request
from lmserve.sched.output import SchedulerOutput
from lmserve.spec.ngram import NgramProposer
from lmserve.spec.policy import DraftPolicy
from lmserve.spec.stats import SpecDecodeStats
from lmserve.tokenizer import Tokenizer, load_tokenizer
from lmserve.utils import resolve_kv_dtype
from lmserve.worker.transforms import TransformContext, apply_transforms


class Proposer(Protocol):
    """A draft source: n-gram lookup or a draft model."""

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]: ...

    def remove(self, request_id: str) -> None: ...


class Speculator:
    """Draft counts per step and per request; drafts for the running requests after each step."""

    def __init__(self, spec: SpeculativeConfig, proposer: Proposer) -> None:
        self.k = spec.num_speculative_tokens
        self.proposer = proposer
        self.stats = SpecDecodeStats(self.k)  # totals since start (metrics, benchmarks)
        self.policy = DraftPolicy()  # draft counts from acceptance and measured step costs

    def record(self, out: SchedulerOutput, sampled: list[list[int]]) -> SpecDecodeStats:
        """Count each verify run's accepted drafts (engine totals, the draft policy); returns this step's counts."""
        step = SpecDecodeStats(self.k)
        for s, tokens in zip(out.requests, sampled):
            if s.spec_token_ids:
                accepted = max(len(tokens) - 1, 0)
                for stats in (step, self.stats):
                    stats.record(len(s.spec_token_ids), accepted)
                self.policy.record_run(s.request_id, len(s.spec_token_ids), accepted)
        return step

    def record_step(self, num_decodes: int, seconds: float, has_prefill: bool) -> None:
        """What the step cost (drafting included): the policy weighs verify rows against it."""
        self.policy.record_step(num_decodes, seconds, has_prefill)

    def propose(self, running: list[Request]) -> None:
        """Give every caught-up running request the drafts the policy finds worth their verify rows."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]  # not prefilling
        # the verify step adds one token of its own, so a request can take max_tokens - output - 1 drafts
        rooms = [(r, min(self.k, r.max_tokens - len(r.output_token_ids) - 1)) for r in decoding]
        reqs, limits = [r for r, n in rooms if n > 0], [n for _, n in rooms if n > 0]
        seeded = [r.seed is not None and not r.params.greedy for r in reqs]  # their tokens must not vary
        counts = self.policy.plan([r.request_id for r in reqs], limits, len(decoding), seeded)
        reqs, limits = [r for r, n in zip(reqs, counts) if n], [n for n in counts if n]
        if reqs:
            for req, drafts in zip(reqs, self.proposer.propose(reqs, limits)):
                if req.grammar is not None:  # drafts the grammar refuses would only be rejected
                    drafts = drafts[:req.grammar.valid_prefix(drafts, req.max_tokens - len(req.output_token_ids))]
                if req.reasoning_budget is not None:  # drafts stop where the end tag's forcing begins
                    room = req.reasoning_budget.draft_room()
                    drafts = drafts if room is None else drafts[:room]
                req.spec_token_ids = drafts

    def remove(self, request_id: str) -> None:
        """Forget a finished request (its acceptance history, its draft KV)."""
        self.policy.remove(request_id)
        self.proposer.remove(request_id)


def make_proposer(cfg: EngineConfig, tokenizer: Tokenizer, vocab_size: int, num_blocks: int, block_size: int,
                  dtype: torch.dtype, device: torch.device) -> Proposer | None:
    """The draft source named by the speculative config (None: speculation off)."""
    spec = cfg.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from lmserve.engine.draft import DraftModelProposer  # noqa: PLC0415 - only when asked

    # the draft follows --quantization as the target does (auto: the draft file's own blocks where they run)
    draft = load_model(spec.model, dtype, device, quantization=cfg.quantization)
    _check_same_tokenizer(tokenizer, vocab_size, draft)
    # and --kv-cache-dtype (auto: float16 for its kept blocks, as the target's)
    kv_dtype = resolve_kv_dtype(cfg.cache.kv_cache_dtype, next(draft.model.parameters()).dtype,
                                draft.keeps_blocks, device)
    # the target's pipeline (worker/transforms.py) over the draft: no LoRA, the reference attention backend
    done = apply_transforms(TransformContext(draft, device, dtype, kv_dtype=kv_dtype))
    return DraftModelProposer(spec, draft, done, num_blocks, block_size, kv_dtype)


def _check_same_tokenizer(target: Tokenizer, vocab_size: int, draft: LoadedModel) -> None:
    """Refuse a draft model whose vocabulary differs from the target's: its ids would mean other text."""
    tok = load_tokenizer(draft)
    probe = "Speculative decoding needs one vocabulary: <|im_start|> 123 ünïcödé\n\tend."
    same = (draft.config.vocab_size == vocab_size and tok.encode(probe) == target.encode(probe)
            and tok.vocab_size == target.vocab_size
            and all(tok.id_to_piece(i) == target.id_to_piece(i) for i in range(tok.vocab_size)))
    if not same:
        raise ValueError(f"draft model {draft.path} does not share the target model's tokenizer "
                         "(vocabularies differ); speculative decoding needs the same token ids")
