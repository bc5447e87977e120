"""The batched sampler, called once per engine step.

Order: logits -> logit_bias -> min_tokens ban -> grammar mask -> penalties
-> (logprobs) -> greedy rows: argmax | sampling rows: temperature -> top-k -> top-p -> min-p
-> exponential-race sample.

Logprobs are the log-softmax of the processed logits before temperature and the sampling filters.
They reflect what shapes the request's distribution everywhere (bias, min_tokens bans at -inf, grammar
masks, penalties) but not the sampling knobs, so a token's logprob is the same at any temperature,
top-k, top-p or min-p, and a greedy and a sampled request report the same numbers. (vLLM v1's default
"raw_logprobs" is taken earlier, before any processing.)

Nothing here reads a tensor on the host: the only Python loop is over seeded rows, listed in the metadata.

With speculative decoding a request has 1 + k logits rows (its last known token and k drafts); rows
that verify a draft go through `sample/rejection.py`, which keeps the output distribution exactly the
target's (and greedy output exactly argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.layers.kernels.native import native_module
from lmserve.sample.filters import NEG_INF, min_p_filter, top_k_only, top_k_top_p
from lmserve.sample.metadata import SamplingMetadata
from lmserve.sample.penalties import apply_penalties
from lmserve.sample.rejection import accept_drafts
from lmserve.structured.mask import apply_bitmask

# Smallest positive float32: Exp(1) noise is clamped to it so p / noise never becomes 0 / 0 = NaN,
# which argmax would pick.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    """Sampled ids and, when any row asked, logprobs (K = the largest number asked in the batch)."""

    sampled_token_ids: torch.Tensor  # [B] int64 (with drafts: the token kept at each position)
    logprobs: torch.Tensor | None  # [B] float32, logprob of the sampled token
    top_logprob_ids: torch.Tensor | None  # [B, K] int64; a row that asked for k < K uses the first k
    top_logprobs: torch.Tensor | None  # [B, K] float32, descending
    accepted: torch.Tensor | None = None  # [B] bool: the row's draft was accepted (None: no drafts)


class Sampler:
    """Stateless: all per-request state lives in SamplingMetadata (and the requests' generators)."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Pick one token per row of logits [B, V] (any float dtype; computed in float32)."""
        logits = process_logits(logits.to(torch.float32, copy=meta.writes_logits), meta)  # [B, V]
        if meta.all_greedy and meta.draft_ids is None and meta.max_num_logprobs is None:
            return SamplerOutput(*argmax_with_logprob(logits), None, None)
        accepted = None
        if meta.draft_ids is None:
            ids = choose_tokens(logits, meta)  # [B]
        else:
            ids, accepted = verify(logits, meta)
        if meta.max_num_logprobs is None:
            # The chosen token's logprob costs one logsumexp per row; monitoring (mean output logprob) uses it.
            chosen = logits.gather(1, ids[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
            return SamplerOutput(ids, chosen, None, None, accepted)
        out = with_logprobs(ids, logits, meta.max_num_logprobs)
        out.accepted = accepted
        return out


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Apply logit_bias, the min_tokens ban, grammar masks and penalties. logits [B, V] float32."""
    if meta.bias_index is not None:
        logits.index_put_(meta.bias_index, meta.bias_values, accumulate=True)
    if meta.ban_index is not None:
        logits[meta.ban_index] = NEG_INF
    if meta.grammar_bitmask is not None:
        apply_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows)
    if not meta.no_penalties:
        logits = apply_penalties(logits, meta)
    return logits


def argmax_with_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows: (argmax [B] int64, its log-softmax [B] float32). On the CPU one native pass pair per row
    (layers/kernels/csrc/fused_ops.cpp): torch's argmax, max and exp-sum each read all [B, V] (~14 ms a step at 16 rows of
    a 262,144-token vocabulary, Gemma 3's)."""
    mod = native_module() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if mod is not None:
        ids, chosen = mod.argmax_logprob(logits)
        return ids, chosen
    return argmax_with_logprob_ref(logits)


def argmax_with_logprob_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference of argmax_with_logprob."""
    ids = logits.argmax(dim=-1)  # [B]
    return ids, logits.gather(1, ids[:, None]).squeeze(1) - logits.logsumexp(dim=-1)


def choose_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Exact argmax on greedy rows, a random draw on the others; [B] int64."""
    if meta.all_greedy:
        return logits.argmax(dim=-1)
    sampled = sample_random(logits, meta)
    if meta.all_random:
        return sampled
    return torch.where(meta.greedy, logits.argmax(dim=-1), sampled)


def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p, then the exponential race; [B] int64."""
    return exponential_race(sampling_probs(logits, meta), meta)


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a sampling row draws from: temperature -> top-k -> top-p -> min-p; [B, V]
    (unnormalised after min-p, which only zeroes entries)."""
    x = logits / meta.temperature[:, None]  # [B, V], a new tensor: logits stay intact for logprobs
    if not (meta.no_top_k and meta.no_top_p):
        x = _apply_top_k_top_p(x, meta)
    probs = x.softmax(dim=-1)  # [B, V]
    if not meta.no_min_p:
        probs = min_p_filter(probs, meta.min_p)
    return probs


def _apply_top_k_top_p(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Filter only the rows that use top-k or top-p; the top-k-only batch skips the full sort."""
    rows = meta.filter_rows
    sub = x if rows is None else x.index_select(0, rows)  # [F, V]
    if meta.no_top_p:
        sub = top_k_only(sub, meta.top_k, meta.max_top_k)
    else:
        sub = top_k_top_p(sub, meta.top_k, meta.top_p)
    return sub if rows is None else x.index_copy_(0, rows, sub)


def verify(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with drafts: (the token kept at each row, whether its draft was accepted), both [B].

    A kept token is the draft where it was accepted, else the row's own draw: argmax on greedy rows,
    the residual distribution on sampling rows whose draft was rejected, p itself on rows with none.
    """
    drafts = meta.draft_ids
    target = logits.argmax(dim=-1)  # [B]
    accepted = (drafts == target) & (drafts >= 0)
    ids = target
    if not meta.all_greedy:
        probs = sampling_probs(logits, meta)
        rand_ok, residual = accept_drafts(probs, drafts, None, _uniform(logits.shape[0], meta))
        own = exponential_race(residual, meta)
        ids = own if meta.all_random else torch.where(meta.greedy, target, own)
        accepted = rand_ok if meta.all_random else torch.where(meta.greedy, accepted, rand_ok)
    return torch.where(accepted, drafts, ids), accepted


def _uniform(n: int, meta: SamplingMetadata) -> torch.Tensor:
    """[n] U(0, 1) acceptance draws; seeded rows draw from their own generator (before their race noise)."""
    u = torch.rand(n, device=meta.temperature.device)
    for row, gen in meta.generators:
        u[row] = torch.rand((), generator=gen, device=u.device)
    return u


def exponential_race(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) picks index i with probability p_i / sum(p): no multinomial, no sync.

    Seeded rows overwrite their noise from their own generator, so their draw depends only on the
    request's seed and its own history, never on the batch around it.
    """
    noise = torch.empty_like(probs).exponential_()  # [B, V]
    for row, gen in meta.generators:
        noise[row].exponential_(generator=gen)
    return (probs / noise.clamp_min_(_TINY)).argmax(dim=-1)


def with_logprobs(ids: torch.Tensor, logits: torch.Tensor, k: int) -> SamplerOutput:
    """Logprob of each chosen token and the batch's top-k, from the processed (pre-temperature) logits."""
    logprobs = logits.log_softmax(dim=-1)  # [B, V]
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1)  # [B]
    top, top_ids = logprobs.topk(k, dim=-1)  # [B, K]
    return SamplerOutput(ids, chosen, top_ids, top)
