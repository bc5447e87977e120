"""SamplingMetadata: every per-step sampling tensor, built once per step from plain per-row data.

Row subsets (who uses top-k, who has a seed...) are decided here from Python values, so the
sampler itself never inspects tensors on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from lmserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence in the batch (built by the engine)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens)
    generator: torch.Generator | None  # the request's own RNG when it has a seed
    stop_ids_for_min_tokens: frozenset[int]  # masked while fewer than min_tokens were generated
    logits_processor: Callable[[torch.Tensor], torch.Tensor] | None = None  # e.g. a grammar mask


@dataclass
class SamplingMetadata:
    """Batch tensors and flags for one sampler call (B rows, V vocabulary)."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (never divided by 0)
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    filter_rows: torch.Tensor | None  # rows that use top-k or top-p
    top_k: torch.Tensor | None  # [len(filter_rows)] int64, V where unused
    top_p: torch.Tensor | None  # [len(filter_rows)] float32, 1.0 where unused
    min_p: torch.Tensor | None  # [B] float32 when any row uses it
    repetition: torch.Tensor | None  # [B, 1] float32 when any row uses it
    frequency: torch.Tensor | None  # [B, 1]
    presence: torch.Tensor | None  # [B, 1]
    output_counts: torch.Tensor | None  # [B, V] float32 counts of generated tokens (when penalties are used)
    prompt_seen: torch.Tensor | None  # [B, V] bool (repetition penalty only)
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) for logit_bias
    bias_values: torch.Tensor | None
    ban_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf (min_tokens)
    generators: list[tuple[int, torch.Generator]]
    processors: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]]
    max_num_logprobs: int | None  # None: nobody asked for logprobs


def build_sampling_metadata(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Build all tensors for `rows` once; work a feature needs is skipped when no row uses it."""
    ps = [r.params for r in rows]
    greedy = [p.greedy for p in ps]
    filt = [i for i, p in enumerate(ps) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
    uses_penalty = any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in ps)
    lps = [p.logprobs for p in ps if p.logprobs is not None]

    def t(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingMetadata(
        temperature=t([1.0 if g else p.temperature for p, g in zip(ps, greedy)]),
        greedy=t(greedy, torch.bool),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        filter_rows=t(filt, torch.int64) if filt else None,
        top_k=t([ps[i].top_k or vocab_size for i in filt], torch.int64) if filt else None,
        top_p=t([ps[i].top_p for i in filt]) if filt else None,
        min_p=t([0.0 if g else p.min_p for p, g in zip(ps, greedy)]) if any(p.min_p > 0 for p in ps) else None,
        repetition=t([[p.repetition_penalty] for p in ps]) if uses_penalty else None,
        frequency=t([[p.frequency_penalty] for p in ps]) if uses_penalty else None,
        presence=t([[p.presence_penalty] for p in ps]) if uses_penalty else None,
        output_counts=_counts([r.output_token_ids for r in rows], vocab_size, device) if uses_penalty else None,
        prompt_seen=_counts([r.prompt_token_ids for r in rows], vocab_size, device) > 0
        if uses_penalty and any(p.repetition_penalty != 1.0 for p in ps) else None,
        **_bias(rows, device),
        ban_index=_min_tokens_ban(rows, device),
        generators=[(i, r.generator) for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy],
        processors=[(i, r.logits_processor) for i, r in enumerate(rows) if r.logits_processor is not None],
        max_num_logprobs=max(lps) if lps else None,
    )


def _counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] occurrence counts, built with one scatter_add over all rows' tokens."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=device)
    if lens.sum():
        rows = torch.from_numpy(np.repeat(np.arange(len(seqs)), lens)).to(device)
        cols = torch.from_numpy(np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])).to(device)
        counts.index_put_((rows, cols), torch.ones_like(cols, dtype=torch.float32), accumulate=True)
    return counts


def _bias(rows: Sequence[SamplingRow], device: torch.device) -> dict:
    entries = [(i, tok, b) for i, r in enumerate(rows) for tok, b in (r.params.logit_bias or {}).items()]
    if not entries:
        return {"bias_index": None, "bias_values": None}
    r, c, v = zip(*entries)
    return {"bias_index": (torch.tensor(r, device=device), torch.tensor(c, device=device)),
            "bias_values": torch.tensor(v, dtype=torch.float32, device=device)}


def _min_tokens_ban(rows: Sequence[SamplingRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    entries = [(i, tok) for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens
               for tok in r.stop_ids_for_min_tokens]
    if not entries:
        return None
    r, c = zip(*entries)
    return torch.tensor(r, device=device), torch.tensor(c, device=device)
