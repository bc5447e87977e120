"""SamplingMetadata: every per-step sampling tensor, built once per step.

Its one builder is the runner's persistent batch (worker/input_batch.InputBatch.metadata); the tests build
theirs through it too. Every decision about which rows use which feature (top-k, penalties, seeds, ...) is
made there from host values, so the sampler never inspects a tensor on the host. A feature no row uses is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Batch tensors and flags for one sampler call (B rows, V vocabulary)."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows so nothing divides by 0
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    # Sampling rows that use top-k or top-p; None when every row does (no gather needed) or none does.
    filter_rows: torch.Tensor | None  # [F] int64
    top_k: torch.Tensor | None  # [F] int64 in [1, V]; V on filter rows without top-k
    max_top_k: int  # largest k in top_k (0 when None): the fast top-k-only path needs it on the host
    top_p: torch.Tensor | None  # [F] float32; 1.0 on filter rows without top-p
    min_p: torch.Tensor | None  # [B] float32; 0.0 on rows without min-p
    repetition: torch.Tensor | None  # [B, 1] float32; 1.0 on rows without it
    frequency: torch.Tensor | None  # [B, 1] float32; 0.0 on rows without it
    presence: torch.Tensor | None  # [B, 1] float32; 0.0 on rows without it
    output_counts: torch.Tensor | None  # [B, V] float32 occurrences in the output (any penalty)
    prompt_seen: torch.Tensor | None  # [B, V] bool token occurs in the prompt (repetition only)
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # ([N] rows, [N] token ids) for logit_bias
    bias_values: torch.Tensor | None  # [N] float32
    ban_index: tuple[torch.Tensor, torch.Tensor] | None  # ([M] rows, [M] token ids) set to -inf (min_tokens)
    generators: list[tuple[int, torch.Generator]]  # sampling rows with a seed
    max_num_logprobs: int | None  # K; None: no row asked for logprobs
    # Speculative decoding: the draft each row verifies (-1: none, the row samples freely). Every drafter
    # here is deterministic (n-gram lookup, a greedy draft model), so q is one-hot and needs no tensor.
    draft_ids: torch.Tensor | None = None  # [B] int64
    # Structured outputs: the allowed tokens of the constrained rows (others pay nothing).
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32, bit t % 32 of word t // 32
    grammar_rows: torch.Tensor | None = None  # [G] int64 logits rows the bitmask rows apply to

    @property
    def no_top_k(self) -> bool:
        """No sampling row uses top-k."""
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        """No sampling row uses top-p."""
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        """No sampling row uses min-p."""
        return self.min_p is None

    @property
    def no_penalties(self) -> bool:
        """No row uses a repetition, frequency or presence penalty."""
        return self.output_counts is None

    @property
    def writes_logits(self) -> bool:
        """Some step edits the logits in place, so the sampler must work on its own copy."""
        return self.bias_index is not None or self.ban_index is not None or self.grammar_bitmask is not None
