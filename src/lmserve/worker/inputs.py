"""Pack a step's scheduled requests into flat tensors (pure functions, numpy-vectorised, no per-token Python)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmserve.layers.paged_attention import PagedAttentionMetadata, PrefillChunk
from lmserve.sched.output import ScheduledRequest


@dataclass
class StepInputs:
    """One forward's inputs. Rows are ordered decodes first, then prefill chunks."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: PagedAttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_ids: list[str]  # request ids in logits order


def order_batch(reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Single-token requests first: attention handles them as one batched decode."""
    return [r for r in reqs if r.num_tokens == 1] + [r for r in reqs if r.num_tokens > 1]


def build_inputs(reqs: list[ScheduledRequest], block_size: int, device: torch.device) -> StepInputs:
    """Flat token ids, positions, slot mapping and block tables for `reqs` (already ordered)."""
    lens = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    starts = np.fromiter((r.start_pos for r in reqs), dtype=np.int64, count=len(reqs))
    ends = np.cumsum(lens)
    req_idx = np.repeat(np.arange(len(reqs)), lens)  # [T] which request each token belongs to
    positions = starts[req_idx] + np.arange(int(ends[-1])) - (ends - lens)[req_idx]
    tables = _block_table(reqs)
    slots = tables[req_idx, positions // block_size] * block_size + positions % block_size
    input_ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in reqs])
    sample = [i for i, r in enumerate(reqs) if r.sample]
    attn = _attention_metadata(reqs, lens, starts, tables, slots, block_size, device)
    return StepInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn=attn,
        logits_indices=torch.from_numpy(ends[sample] - 1).to(device),
        sample_ids=[reqs[i].request_id for i in sample],
    )


def _block_table(reqs: list[ScheduledRequest]) -> np.ndarray:
    """[B, max_blocks] int64, rows padded with block 0 (never read unmasked, never written)."""
    width = max(len(r.block_ids) for r in reqs)
    table = np.zeros((len(reqs), width), dtype=np.int64)
    for i, r in enumerate(reqs):
        table[i, :len(r.block_ids)] = r.block_ids
    return table


def _attention_metadata(reqs: list[ScheduledRequest], lens: np.ndarray, starts: np.ndarray, tables: np.ndarray,
                        slots: np.ndarray, block_size: int, device: torch.device) -> PagedAttentionMetadata:
    num_decodes = int(np.count_nonzero(lens == 1))
    ctx = starts + lens  # tokens in the cache after this step
    dec_ctx = ctx[:num_decodes]
    dec_blocks = int(-(-dec_ctx.max() // block_size)) if num_decodes else 1
    key_pos = np.arange(dec_blocks * block_size)
    decode_mask = (key_pos[None, :] < dec_ctx[:, None])[:, None, None, :]
    prefills, q_start = [], int(lens[:num_decodes].sum())
    for i in range(num_decodes, len(reqs)):
        q_len, c_len = int(lens[i]), int(ctx[i])
        n_blocks = -(-c_len // block_size)
        mask = None
        if c_len != q_len:  # queries sit after a cached prefix: query k may see keys <= start + k
            mask = torch.from_numpy(np.arange(c_len)[None, :] <= (starts[i] + np.arange(q_len))[:, None]).to(device)
        prefills.append(PrefillChunk(q_start, q_len, c_len, torch.from_numpy(tables[i, :n_blocks]).to(device), mask))
        q_start += q_len
    return PagedAttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decodes=num_decodes,
        decode_block_tables=torch.from_numpy(tables[:num_decodes, :dec_blocks].copy()).to(device),
        decode_mask=torch.from_numpy(decode_mask).to(device),
        decode_context_lens=torch.from_numpy(dec_ctx.copy()).to(device),
        prefills=prefills,
    )
