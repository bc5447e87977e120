"""The batched sampler: logits -> bias -> min_tokens ban -> processors -> penalties -> (logprobs) ->
greedy argmax | temperature -> top-k -> top-p -> min-p -> exponential-race sample.

Logprobs are the log-softmax of the processed logits before temperature (what the model, with the
request's biases and penalties, believes), as OpenAI and vLLM report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """Sampled ids and, when any row asked, logprobs (K = the largest number asked in the batch)."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, logprob of the sampled token
    top_logprob_ids: torch.Tensor | None  # [B, K] int64
    top_logprobs: torch.Tensor | None  # [B, K] float32


class Sampler:
    """Stateless: all per-request state lives in SamplingMetadata (and the requests' generators)."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = process_logits(logits.float().clone(), meta)  # [B, V]
        logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            ids = greedy_ids
        else:
            sampled = sample_random(logits, meta)
            ids = sampled if meta.all_random else torch.where(meta.greedy, greedy_ids, sampled)
        if logprobs is None:
            return SamplerOutput(ids, None, None, None)
        chosen = logprobs.gather(1, ids[:, None])[:, 0]
        top, top_ids = (logprobs.topk(meta.max_num_logprobs, dim=-1) if meta.max_num_logprobs
                        else (logprobs[:, :0], ids[:, None][:, :0]))
        return SamplerOutput(ids, chosen, top_ids, top)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Apply logit_bias, the min_tokens ban, per-row processors and penalties (in place)."""
    if meta.bias_index is not None:
        logits.index_put_(meta.bias_index, meta.bias_values, accumulate=True)
    if meta.ban_index is not None:
        logits[meta.ban_index] = float("-inf")
    for row, fn in meta.processors:
        logits[row] = fn(logits[row])
    if meta.output_counts is not None:
        logits = apply_penalties(logits, meta)
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM: divide positive, multiply negative logits of seen tokens), then OpenAI's
    frequency (x count in output) and presence (once if in output) subtractions."""
    counts = meta.output_counts
    in_output = counts > 0
    if meta.prompt_seen is not None:
        seen = in_output | meta.prompt_seen
        pen = meta.repetition.expand_as(logits)
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
    return logits - meta.frequency * counts - meta.presence * in_output


def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p, then sample by the exponential race (no host sync)."""
    x = logits / meta.temperature[:, None]
    if meta.filter_rows is not None:
        rows = meta.filter_rows
        x.index_copy_(0, rows, top_k_top_p(x.index_select(0, rows), meta.top_k, meta.top_p))
    probs = torch.softmax(x, dim=-1)
    if meta.min_p is not None:
        keep = probs >= meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(keep, probs, 0.0)
    # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i / sum(p).
    noise = torch.empty_like(probs).exponential_()
    for row, gen in meta.generators:
        noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def top_k_top_p(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's top k, then the smallest top set holding mass p (one sort, scattered back)."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    pos = torch.arange(x.shape[-1], device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(pos >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    drop = (mass_before >= p[:, None]) & (pos > 0)  # the top token always stays
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
