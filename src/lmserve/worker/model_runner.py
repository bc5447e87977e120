"""ModelRunner: owns the KV cache tensors; one `execute` = upload inputs, one forward, sample, one download."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmserve.layers.paged_attention import PagedAttention, native_decode
from lmserve.models.config import ModelConfig
from lmserve.request import TokenLogprobs
from lmserve.sample import Sampler, SamplingRow, build_sampling_metadata
from lmserve.sched.output import SchedulerOutput
from lmserve.worker.inputs import build_inputs, order_batch


@dataclass
class RunnerOutput:
    """Sampled token (and logprobs when asked) per request that sampled this step."""

    sampled: dict[str, tuple[int, TokenLogprobs | None]]
    num_decodes: int
    num_prefill_tokens: int
    chosen_logprobs: dict[str, float] = field(default_factory=dict)  # every sampled token's logprob


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for `block_size` tokens in every layer."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    """Runs the model over a scheduled batch against the paged KV cache."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.cfg, self.block_size, self.device = model, cfg, block_size, device
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.sampler = Sampler()
        # build/load the native decode kernel now (once per machine, ~30 s), not inside the first request
        native_decode(self.kv_caches[0], torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> RunnerOutput:
        """One forward over the whole batch; only the rows that sample go through the LM head."""
        reqs = order_batch(out.requests)
        inputs = build_inputs(reqs, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, PagedAttention(self.kv_caches, inputs.attn))
        num_decodes = inputs.attn.num_decodes
        prefill_tokens = int(inputs.input_ids.shape[0]) - num_decodes
        if not inputs.sample_ids:
            return RunnerOutput({}, num_decodes, prefill_tokens)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, vocab]
        meta = build_sampling_metadata([rows[r] for r in inputs.sample_ids], self.cfg.vocab_size, self.device)
        result = self.sampler(logits, meta)
        sampled, chosen = _to_host(inputs.sample_ids, result, rows)
        return RunnerOutput(sampled, num_decodes, prefill_tokens, chosen)


def _to_host(ids: list[str], result, rows: dict[str, SamplingRow]
             ) -> tuple[dict[str, tuple[int, TokenLogprobs | None]], dict[str, float]]:
    """Download sampled ids and logprobs once, as Python values keyed by request id.

    Returns (token and asked-for logprobs per request, the chosen token's logprob per request).
    """
    tokens = result.sampled_token_ids.tolist()
    chosen = result.logprobs.tolist() if result.logprobs is not None else []
    chosen_by_id = dict(zip(ids, chosen))
    if result.top_logprobs is None:
        return {rid: (tok, None) for rid, tok in zip(ids, tokens)}, chosen_by_id
    top_ids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else [[]] * len(ids)
    top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else [[]] * len(ids)
    out: dict[str, tuple[int, TokenLogprobs | None]] = {}
    for i, rid in enumerate(ids):
        k = rows[rid].params.logprobs
        lp = None if k is None else TokenLogprobs(tokens[i], chosen[i], list(zip(top_ids[i][:k], top_lp[i][:k])))
        out[rid] = (tokens[i], lp)
    return out, chosen_by_id
