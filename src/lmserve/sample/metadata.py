"""SamplingMetadata: every per-step sampling tensor, built once per step.

The engine builds it from its persistent batch (worker/input_batch.py); `build_sampling_metadata`
here builds the same thing from plain per-row data and stays as the reference the tests compare with.
All decisions about which rows use which feature (top-k, penalties, seeds, ...) are made here from
Python values, so the sampler never inspects a tensor on the host. A feature no row uses is None.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from lmserve.sampling_params import SamplingParams

LogitsProcessor = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence in the batch (built by the runner)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens)
    # The request's own RNG when it has a seed: advanced only by this row's draws, so the request
    # gets the same tokens whatever else shares the batch.
    generator: torch.Generator | None
    stop_ids_for_min_tokens: frozenset[int]  # eos (unless ignore_eos) + stop_token_ids
    logits_processor: LogitsProcessor | None = None  # [V] -> [V], e.g. a grammar mask


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
    processors: list[tuple[int, LogitsProcessor]]
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
        return (self.bias_index is not None or self.ban_index is not None or bool(self.processors)
                or self.grammar_bitmask is not None)


def build_sampling_metadata(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Build all tensors for `rows` once; a feature no row uses costs nothing in the sampler."""
    ps = [r.params for r in rows]
    greedy = [p.greedy for p in ps]
    lps = [p.logprobs for p in ps if p.logprobs is not None]
    return SamplingMetadata(
        temperature=_floats([1.0 if g else p.temperature for p, g in zip(ps, greedy)], device),
        greedy=_upload(greedy, torch.bool, device),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        **_filters(ps, vocab_size, device),
        min_p=_min_p(ps, device),
        **_penalties(rows, vocab_size, device),
        **_bias(rows, device),
        ban_index=_min_tokens_ban(rows, vocab_size, device),
        generators=[(i, r.generator) for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy],
        processors=[(i, r.logits_processor) for i, r in enumerate(rows) if r.logits_processor is not None],
        max_num_logprobs=max(lps) if lps else None,
    )


def _upload(values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values to a device tensor without waiting for the device."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        # Pinned + non_blocking: the copy queues behind the running forward instead of waiting for it.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return _upload(values, torch.float32, device)


def _min_p(ps: Sequence[SamplingParams], device: torch.device) -> torch.Tensor | None:
    """[B] min-p on sampling rows (0 elsewhere), or None when no sampling row uses it."""
    values = [0.0 if p.greedy else p.min_p for p in ps]
    return _floats(values, device) if any(v > 0 for v in values) else None


def _filters(ps: Sequence[SamplingParams], vocab: int, device: torch.device) -> dict:
    """Top-k / top-p tensors over only the sampling rows that use either (k >= V counts as off)."""
    ks = [p.top_k if not p.greedy and 0 < p.top_k < vocab else vocab for p in ps]
    tps = [p.top_p if not p.greedy else 1.0 for p in ps]
    rows = [i for i in range(len(ps)) if ks[i] < vocab or tps[i] < 1.0]
    any_k, any_p = any(ks[i] < vocab for i in rows), any(tps[i] < 1.0 for i in rows)
    return {
        "filter_rows": _upload(rows, torch.int64, device) if 0 < len(rows) < len(ps) else None,
        "top_k": _upload([ks[i] for i in rows], torch.int64, device) if any_k else None,
        "max_top_k": max(ks[i] for i in rows) if any_k else 0,
        "top_p": _floats([tps[i] for i in rows], device) if any_p else None,
    }


def _penalties(rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> dict:
    """Per-row penalty columns and the token statistics they need; all None when nobody uses one."""
    ps = [r.params for r in rows]
    use_rep = any(p.repetition_penalty != 1.0 for p in ps)
    use_freq = any(p.frequency_penalty != 0.0 for p in ps)
    use_pres = any(p.presence_penalty != 0.0 for p in ps)
    any_used = use_rep or use_freq or use_pres

    def column(values: list[float], used: bool) -> torch.Tensor | None:
        return _floats(values, device)[:, None] if used else None

    return {
        "repetition": column([p.repetition_penalty for p in ps], use_rep),
        "frequency": column([p.frequency_penalty for p in ps], use_freq),
        "presence": column([p.presence_penalty for p in ps], use_pres),
        "output_counts": _token_counts([r.output_token_ids for r in rows], vocab, device) if any_used else None,
        "prompt_seen": _token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0 if use_rep else None,
    }


def _token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 occurrence counts: one upload of all rows' tokens, one scatter-add on the device."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    counts = torch.zeros(len(seqs) * vocab, dtype=torch.float32, device=device)
    total = int(lens.sum())
    if total:
        tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
        flat = _upload(np.repeat(np.arange(len(seqs), dtype=np.int64) * vocab, lens) + tokens, torch.int64, device)
        counts.scatter_add_(0, flat, torch.ones(total, device=device))
    return counts.view(len(seqs), vocab)


def _bias(rows: Sequence[SamplingRow], device: torch.device) -> dict:
    """logit_bias as (row, token) index pairs and values for one index_put_."""
    entries = [(i, tok, b) for i, r in enumerate(rows) for tok, b in (r.params.logit_bias or {}).items()]
    if not entries:
        return {"bias_index": None, "bias_values": None}
    r, c, v = zip(*entries)
    return {"bias_index": _index_pair(r, c, device), "bias_values": _floats(v, device)}


def _min_tokens_ban(rows: Sequence[SamplingRow], vocab: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs of stop ids to mask while a row has generated fewer than min_tokens."""
    entries = [(i, tok) for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens
               for tok in r.stop_ids_for_min_tokens if tok < vocab]  # an eos id past the LM head can't be sampled
    if not entries:
        return None
    r, c = zip(*entries)
    return _index_pair(r, c, device)


def _index_pair(r: Sequence[int], c: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index tensors uploaded together ([2, N] then split)."""
    both = _upload([r, c], torch.int64, device)
    return both[0], both[1]
