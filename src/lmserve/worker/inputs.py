"""Pack a step's scheduled requests into flat arrays (pure functions, numpy-vectorised, no per-token Python).

Token ids and block tables are gathered from the persistent rows (worker/input_batch.py, after `apply`
wrote this step's diffs and drafts into them). The result holds numpy arrays; `worker/upload.to_device`
moves them all to the device in one copy.

Row order: the decode group first (requests whose known part is one token: a plain decode, or a verify
step of 1 + k tokens), then prefill chunks. Every token of the decode group is attended as its own
query row with its own context length (its position + 1) over its request's block table, so a verify
step computes each position exactly as the plain decode of that position would (same kernel, same
summation order): this is what keeps speculative decoding token-for-token lossless in float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from lmserve.layers.attention.paged import PagedAttentionMetadata, PrefillChunk
from lmserve.sched.output import ScheduledRequest
from lmserve.worker.block_table import RowTable


@dataclass
class StepInputs:
    """One forward's inputs (numpy until uploaded)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    attn: PagedAttentionMetadata  # the first KV group's (every layer's, in a model with one group)
    logits_indices: np.ndarray  # [N] flat rows whose logits the sampler needs (1 + drafts per sampling request)
    prompt_lp_indices: np.ndarray  # [P] flat rows whose logits score the next prompt token
    # the other KV groups' metadata (cache/kv_groups.py): `attn` with their own slots and block tables
    group_attn: list[PagedAttentionMetadata] = field(default_factory=list)


@dataclass
class StepLayout:
    """Host-side bookkeeping of the step, never uploaded."""

    order: list[int]  # order[j] = index in scheduler order of the j-th request in flat order
    sample_reqs: list[int]  # scheduler-order indices of the requests that sample, in logits order
    num_logits: list[int]  # logits rows of each of them (1 + its drafts)
    prompt_lp: list[tuple[int, int]]  # (scheduler-order index, number of prompt-logprob rows) in row order
    num_decode_tokens: int
    num_prefill_tokens: int
    pool: list[tuple[int, int]]  # pooling requests: (scheduler-order index, flat row of its first token this step)


def order_batch(reqs: list[ScheduledRequest]) -> list[int]:
    """Indices of `reqs`: the decode group (one known token, with or without drafts) first, then prefills."""
    dec = [i for i, r in enumerate(reqs) if r.num_known == 1]
    return dec + [i for i, r in enumerate(reqs) if r.num_known != 1]


def build_inputs(scheduled: list[ScheduledRequest], index: dict[str, int], tokens: RowTable, blocks: RowTable,
                 block_size: int, group_blocks: Sequence[RowTable] = (),
                 spans: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> tuple[StepInputs, StepLayout]:
    """Flat token ids, positions, slot mapping, block tables and logits rows for the scheduled requests.

    `index` maps a request id to its row in `tokens` (its ids, drafts after the known ones) and `blocks`;
    `group_blocks` are the tables of the other KV groups, each with its own slots and tables in `group_attn`;
    `spans` a request's [a, b) position spans attended bidirectionally (worker/mm_encoder.py `bidirectional_spans`).
    """
    order = order_batch(scheduled)
    reqs = [scheduled[i] for i in order]
    rows = np.fromiter((index[r.request_id] for r in reqs), dtype=np.int64, count=len(reqs))
    lens = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    starts = np.fromiter((r.start_pos for r in reqs), dtype=np.int64, count=len(reqs))
    ends = np.cumsum(lens)
    req_idx = np.repeat(np.arange(len(reqs)), lens)  # [T] which request each token belongs to
    positions = starts[req_idx] + np.arange(int(ends[-1])) - (ends - lens)[req_idx]
    tables = _tables(blocks, rows)
    slots = tables[req_idx, positions // block_size] * block_size + positions % block_size
    input_ids = tokens.array[rows[req_idx], positions]  # [T] known tokens, then each request's drafts
    num_dec_reqs = sum(1 for r in reqs if r.num_known == 1)
    num_dec = int(ends[num_dec_reqs - 1]) if num_dec_reqs else 0
    attn = _attention_metadata(reqs[num_dec_reqs:], lens[num_dec_reqs:], starts[num_dec_reqs:], tables,
                               num_dec_reqs, slots, positions, req_idx, num_dec, block_size, spans or {})
    group_attn = []
    for table in group_blocks:  # the same steps over another group's blocks: only slots and tables differ
        t = _tables(table, rows)
        group_attn.append(_group_metadata(attn, t, t[req_idx, positions // block_size] * block_size
                                          + positions % block_size, req_idx[:num_dec], num_dec_reqs))
    logits_idx, sample_reqs, num_logits = _logits_rows(reqs, ends, order)
    lp_idx, prompt_lp = _prompt_lp_rows(reqs, ends, starts, order)
    pool = [(order[j], int(ends[j]) - r.num_tokens) for j, r in enumerate(reqs) if r.pool]
    layout = StepLayout(order, sample_reqs, num_logits, prompt_lp, num_dec, int(ends[-1]) - num_dec, pool)
    return StepInputs(input_ids, positions, attn, logits_idx, lp_idx, group_attn), layout


def _tables(blocks: RowTable, rows: np.ndarray) -> np.ndarray:
    """[B, max_blocks] the rows' block tables, a copy (fancy indexing) padded with block 0: never read unmasked."""
    num_blocks = blocks.lens[rows]
    tables = blocks.array[rows, :int(num_blocks.max())]
    tables[np.arange(tables.shape[1])[None, :] >= num_blocks[:, None]] = 0
    return tables


def _group_metadata(base: PagedAttentionMetadata, tables: np.ndarray, slots: np.ndarray, dec_rows: np.ndarray,
                    num_dec_reqs: int) -> PagedAttentionMetadata:
    """`base` (another group's metadata) over this group's block tables and slots; masks and lengths are shared."""
    prefills = [dataclasses.replace(p, block_table=tables[num_dec_reqs + i, :len(p.block_table)].copy())
                for i, p in enumerate(base.prefills)]
    return dataclasses.replace(
        base, slot_mapping=slots, prefills=prefills,
        decode_block_tables=np.ascontiguousarray(tables[dec_rows, :base.decode_block_tables.shape[1]]),
        prefill_block_tables=np.ascontiguousarray(tables[num_dec_reqs:]) if prefills else None)


def _logits_rows(reqs: list[ScheduledRequest], ends: np.ndarray, order: list[int]
                 ) -> tuple[np.ndarray, list[int], list[int]]:
    """The last known token's row and every draft's row, for each request that samples (pooling ones never do)."""
    rows, who, counts = [], [], []
    for j, r in enumerate(reqs):
        if r.sample and not r.pool:
            m = 1 + len(r.spec_token_ids)
            rows.append(np.arange(int(ends[j]) - m, int(ends[j])))
            who.append(order[j])
            counts.append(m)
    idx = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return idx.astype(np.int64), who, counts


def _prompt_lp_rows(reqs: list[ScheduledRequest], ends: np.ndarray, starts: np.ndarray, order: list[int]
                    ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Rows of the prompt positions whose logits score the next prompt token (prompt logprobs)."""
    rows, who = [], []
    for j, r in enumerate(reqs):
        if r.prompt_logprob_range is None or r.prompt_logprob_range[1] <= r.prompt_logprob_range[0]:
            continue
        a, b = r.prompt_logprob_range
        first = int(ends[j]) - r.num_tokens + (a - int(starts[j]))
        rows.append(np.arange(first, first + b - a))
        who.append((order[j], b - a))
    idx = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return idx.astype(np.int64), who


def _attention_metadata(prefill_reqs: list[ScheduledRequest], lens: np.ndarray, starts: np.ndarray,
                        tables: np.ndarray, num_dec_reqs: int, slots: np.ndarray, positions: np.ndarray,
                        req_idx: np.ndarray, num_dec: int, block_size: int,
                        spans: Mapping[str, Sequence[tuple[int, int]]]) -> PagedAttentionMetadata:
    dec_ctx = positions[:num_dec] + 1  # each decode-group token sees the keys up to its own position
    dec_blocks = int(-(-dec_ctx.max() // block_size)) if num_dec else 1
    key_pos = np.arange(dec_blocks * block_size)
    decode_mask = (key_pos[None, :] < dec_ctx[:, None])[:, None, None, :]
    dec_tables = tables[req_idx[:num_dec], :dec_blocks]
    prefills, q_start = [], num_dec
    for i, r in enumerate(prefill_reqs):
        q_len, c_len = int(lens[i]), int(starts[i] + lens[i])
        n_blocks = -(-c_len // block_size)
        mask = None
        if c_len != q_len:  # queries sit after a cached prefix: query k may see keys <= start + k
            mask = np.arange(c_len)[None, :] <= (starts[i] + np.arange(q_len))[:, None]
        mine = tuple((a, b) for a, b in spans.get(r.request_id, ()) if a < c_len and b > starts[i])
        prefills.append(PrefillChunk(q_start, q_len, c_len, tables[num_dec_reqs + i, :n_blocks].copy(), mask, mine))
        q_start += q_len
    return PagedAttentionMetadata(
        slot_mapping=slots,
        num_decodes=num_dec,
        decode_block_tables=np.ascontiguousarray(dec_tables),
        decode_mask=decode_mask,
        decode_context_lens=dec_ctx.copy(),
        prefills=prefills,
        prefill_block_tables=np.ascontiguousarray(tables[num_dec_reqs:]) if prefills else None,
        prefill_table_rows=req_idx[num_dec:] - num_dec_reqs if prefills else None,
        prefill_context_lens=positions[num_dec:] + 1 if prefills else None,
        prefill_query_start_loc=np.concatenate([np.zeros(1, np.int64), np.cumsum(lens)]) if prefills else None,
        prefill_seq_lens=starts + lens if prefills else None,
    )
