"""Attention over the paged KV cache: write this step's K/V into their slots, then read by block table.

The batch is ordered decodes first (one query token each), then prefill chunks. Decodes run as one
call per layer with no Python loop over sequences: the native CPU kernel (layers/kernels/native.py) reads K/V
in place where it is available, otherwise one batched gather + SDPA. Where the native kernel applies,
every prefill token is attended by it too, as its own query row over its request's blocks: a token's
output is then the same bits whether it was prefilled whole, in chunks, after a prefix-cache hit, after
preemption, or decoded (SDPA would sum in another order, and int8-quantized activations can turn that
last-bit difference into another token). Elsewhere prefill chunks run one SDPA per chunk.
A layer's `AttnOptions` (scale, sliding window, soft-cap) reach every one of these paths; sinks only the
PyTorch ones (the native kernel stands aside for them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lmserve.layers.attention.context import DEFAULT, AttnOptions, attention_ref, causal_sdpa
from lmserve.layers.attention.kv_quant import as_values, is_quantized, quantize
from lmserve.layers.kernels.native import native_module


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens: rows [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    context_len: int  # tokens in the cache for this sequence after this step (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_used] int64
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when the chunk is the whole context
    # [a, b) positions attended bidirectionally (Gemma 3's images), each ending within this chunk's context
    spans: tuple[tuple[int, int], ...] = ()


@dataclass
class PagedAttentionMetadata:
    """Everything attention needs for one step, built once by the model runner (not per layer)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (block * block_size + offset) per new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64 (padded with block 0)
    # [num_decodes, 1, 1, max_blocks * block_size] bool: key within context; None: derived on the device from
    # decode_context_lens (the fixed-shape inputs of a captured CUDA graph have no host-built mask)
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64, for the native kernel
    # the native kernel's view of the prefill tokens, each its own query row: the prefill requests' block
    # tables [R, max_blocks], each token's row in them [P] and its context length (position + 1) [P]
    prefill_block_tables: torch.Tensor | None = None
    prefill_table_rows: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    # the same prefill requests per sequence, for kernels that tile a chunk's queries (Triton's prefill): each
    # request's first row counted from the first prefill row [R + 1], and its context after this step [R]
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None

    def cuts(self) -> list[int]:
        """Row offsets where the step may be cut into parts of whole sequences (`rows`): between decodes and between
        prefill chunks (a chunk is one sequence's rows and is never cut itself)."""
        return [*range(self.num_decodes + 1), *(p.q_start + p.q_len for p in self.prefills)]

    def rows(self, lo: int, hi: int) -> PagedAttentionMetadata:
        """This step's rows [lo, hi) as a step of its own (`lo` and `hi` from `cuts`)."""
        d_lo, d_hi = min(lo, self.num_decodes), min(hi, self.num_decodes)
        mask = self.decode_mask[d_lo:d_hi] if self.decode_mask is not None else None
        lens = self.decode_context_lens[d_lo:d_hi] if self.decode_context_lens is not None else None
        part = replace(self, slot_mapping=self.slot_mapping[lo:hi], num_decodes=d_hi - d_lo,
                       decode_block_tables=self.decode_block_tables[d_lo:d_hi], decode_mask=mask,
                       decode_context_lens=lens)
        mine = [i for i, p in enumerate(self.prefills) if lo <= p.q_start and p.q_start + p.q_len <= hi]
        if not mine:
            return replace(part, prefills=[], prefill_block_tables=None, prefill_table_rows=None,
                           prefill_context_lens=None, prefill_query_start_loc=None, prefill_seq_lens=None)
        return replace(part, prefills=[replace(p, q_start=p.q_start - lo) for p in self.prefills[mine[0]:mine[-1] + 1]],
                       **self._prefill_view(mine[0], mine[-1] + 1))

    def _prefill_view(self, a: int, b: int) -> dict:
        """The per-token and per-request prefill fields of chunks [a, b) alone: their tokens counted from their first,
        their requests' table rows from chunk a's."""
        first = self.prefills[a].q_start - self.num_decodes  # token offsets within the step's prefill rows
        last = self.prefills[b - 1].q_start + self.prefills[b - 1].q_len - self.num_decodes
        out = {}
        if self.prefill_block_tables is not None:
            out.update(prefill_block_tables=self.prefill_block_tables[a:b],
                       prefill_table_rows=self.prefill_table_rows[first:last] - a,
                       prefill_context_lens=self.prefill_context_lens[first:last])
        if self.prefill_query_start_loc is not None:
            out.update(prefill_query_start_loc=self.prefill_query_start_loc[a:b + 1] - self.prefill_query_start_loc[a],
                       prefill_seq_lens=self.prefill_seq_lens[a:b])
        return out


class PagedRows:
    """`cuts()` and `rows()` of an attention context over the step's PagedAttentionMetadata `meta` (a dataclass):
    a pipeline micro-batch's attention is the same context over its rows' metadata."""

    meta: PagedAttentionMetadata

    def cuts(self) -> list[int]:
        """Where the step's rows may be cut (PagedAttentionMetadata.cuts)."""
        return self.meta.cuts()

    def rows(self, lo: int, hi: int):
        """This context for rows [lo, hi) of the step alone."""
        return replace(self, meta=self.meta.rows(lo, hi))


@dataclass
class PagedAttention(PagedRows):
    """AttentionContext over the engine's KV cache (one [2, blocks, block_size, kv_heads, W] per layer: W = head_dim,
    or head_dim + head_dim / 16 for a quantized cache's codes and scales, layers/attention/kv_quant.py)."""

    kv_caches: list[torch.Tensor]
    meta: PagedAttentionMetadata

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               opts: AttnOptions = DEFAULT) -> torch.Tensor:
        cache = self.kv_caches[layer_idx]
        write_kv(cache, k, v, self.meta.slot_mapping)
        m = self.meta
        outs = []
        if m.num_decodes:
            outs.append(self._decode(q[:m.num_decodes], cache, opts))
        rows = q[m.num_decodes:]
        kernel = native_decode(cache, q, opts) if m.prefills and m.prefill_context_lens is not None else None
        if kernel is not None and any(p.spans for p in m.prefills):
            # a chunk with bidirectional spans has queries that see later keys: SDPA over its context; the others
            # keep the native rows, so a request's bits never depend on its batch
            for p in m.prefills:
                outs.append(self._native_chunk(kernel, q, p, cache, opts) if not p.spans else self._sdpa_chunk(
                    q, k, v, p, cache, opts))
            return torch.cat(outs) if len(outs) > 1 else outs[0]
        if kernel is not None:
            # each prompt token attends exactly as it would have as a decode row: a token's K/V and output
            # never depend on whether it was prefilled, chunked, recomputed after preemption or decoded
            out = kernel.paged_decode_attention(rows, cache[0], cache[1], m.prefill_block_tables,
                                                m.prefill_context_lens, _scale(q, opts), m.prefill_table_rows,
                                                opts.window or 0, opts.soft_cap or 0.0)
            outs.append(out.reshape(rows.shape[0], -1))
            return torch.cat(outs) if len(outs) > 1 else outs[0]
        for p in m.prefills:
            outs.append(self._sdpa_chunk(q, k, v, p, cache, opts))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _sdpa_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PrefillChunk, cache: torch.Tensor,
                    opts: AttnOptions) -> torch.Tensor:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.mask is None and not is_quantized(cache.dtype):  # no cached prefix: attend over the fresh K/V
            return causal_sdpa(q[rows], k[rows], v[rows], opts=opts, spans=p.spans)
        # after a prefix, or over a quantized cache (prompt tokens see the values decode steps read)
        kc, vc = gather_context(cache, p.block_table, p.context_len)
        return causal_sdpa(q[rows], as_values(kc, q.dtype), as_values(vc, q.dtype), p.mask, opts, p.spans)

    def _native_chunk(self, kernel, q: torch.Tensor, p: PrefillChunk, cache: torch.Tensor,
                      opts: AttnOptions) -> torch.Tensor:
        """One chunk's rows through the native kernel (its slice of the step's per-token prefill view)."""
        m = self.meta
        lo, hi = p.q_start - m.num_decodes, p.q_start - m.num_decodes + p.q_len
        out = kernel.paged_decode_attention(q[p.q_start:p.q_start + p.q_len], cache[0], cache[1],
                                            m.prefill_block_tables, m.prefill_context_lens[lo:hi], _scale(q, opts),
                                            m.prefill_table_rows[lo:hi], opts.window or 0, opts.soft_cap or 0.0)
        return out.reshape(p.q_len, -1)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, opts: AttnOptions) -> torch.Tensor:
        """The native kernel where it applies (CPU float32, head_dim 64/128/256), else gather + SDPA."""
        m = self.meta
        kernel = native_decode(cache, q, opts)
        if kernel is None or m.decode_context_lens is None:
            num_keys = m.decode_block_tables.shape[1] * cache.shape[2]
            mask = m.decode_mask if m.decode_mask is not None else context_mask(m.decode_context_lens, num_keys)
            if opts.window is not None:  # keys older than the window: positions < context_len - window
                mask = mask & ~context_mask(m.decode_context_lens - opts.window, num_keys)
            return decode_attention(q, cache, m.decode_block_tables, mask, opts)
        out = kernel.paged_decode_attention(q, cache[0], cache[1], m.decode_block_tables, m.decode_context_lens,
                                            _scale(q, opts), None, opts.window or 0, opts.soft_cap or 0.0)
        return out.reshape(q.shape[0], -1)


def _scale(q: torch.Tensor, opts: AttnOptions) -> float:
    return opts.scale if opts.scale is not None else q.shape[-1] ** -0.5


def native_decode(cache: torch.Tensor, q: torch.Tensor, opts: AttnOptions = DEFAULT):
    """The compiled paged-decode module when this cache, query and layer can use it (float32, float16 or quantized
    cache; any scale, window or soft-cap; no sinks), else None."""
    if cache.device.type != "cpu" or not (cache.dtype in (torch.float32, torch.float16) or is_quantized(cache.dtype)) \
            or q.dtype != torch.float32 or q.shape[-1] not in (64, 128, 256) or opts.sinks is not None:
        return None
    return native_module()


def context_mask(context_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, 1, 1, num_keys] bool: key k is within row b's context (k < context_lens[b]); no host values."""
    keys = torch.arange(num_keys, device=context_lens.device)
    return (keys[None, :] < context_lens[:, None])[:, None, None, :]


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, kv_heads, head_dim] at their slots, in the cache's format: on CPU the native writer (the
    decode stack's own, so both paths leave the same bytes), else write_kv_reference."""
    mod = native_decode(cache, k) if k.dtype == torch.float32 else None
    if mod is not None:
        mod.write_kv(cache, k, v, slot_mapping)
    else:
        write_kv_reference(cache, k, v, slot_mapping)


def write_kv_reference(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The PyTorch writer: converted (float caches) or quantized (kv_quant.quantize) into the slots."""
    _, _, _, h, w = cache.shape
    if is_quantized(cache.dtype):  # copied as bytes: torch has no index_copy_ for float8
        raw, encode = cache.view(torch.uint8), lambda x: quantize(x, cache.dtype).view(torch.uint8)
    else:
        raw, encode = cache, lambda x: x.to(cache.dtype)
    raw[0].view(-1, h, w).index_copy_(0, slot_mapping, encode(k))
    raw[1].view(-1, h, w).index_copy_(0, slot_mapping, encode(v))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V rows, each [context_len, kv_heads, W]."""
    _, _, _, h, w = cache.shape
    k = select_blocks(cache[0], block_table).view(-1, h, w)[:context_len]
    v = select_blocks(cache[1], block_table).view(-1, h, w)[:context_len]
    return k, v  # in the cache's format: the caller takes their values (kv_quant.as_values)


def select_blocks(part: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """part[blocks] (index_select copies whole blocks, 4x faster than advanced indexing on CPU); one-byte formats as
    bytes (torch has no index_select for float8)."""
    if is_quantized(part.dtype):
        return part.view(torch.uint8).index_select(0, blocks).view(part.dtype)
    return part.index_select(0, blocks)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     mask: torch.Tensor, opts: AttnOptions = DEFAULT) -> torch.Tensor:
    """Batched single-token attention: q [B, H, D] over each sequence's blocks -> [B, H * D]."""
    b, heads, d = q.shape
    kv_heads, w = cache.shape[3], cache.shape[4]
    flat = block_tables.flatten()
    # [B, Hkv, L, D], as values in the queries' dtype (a float16 or quantized cache under float32 queries)
    k = as_values(select_blocks(cache[0], flat).view(b, -1, kv_heads, w), q.dtype).transpose(1, 2)
    v = as_values(select_blocks(cache[1], flat).view(b, -1, kv_heads, w), q.dtype).transpose(1, 2)
    if opts.soft_cap is not None or opts.sinks is not None:  # SDPA has neither: the plain definition
        return attention_ref(q[:, None], k.transpose(1, 2), v.transpose(1, 2), mask.view(b, 1, -1),
                             opts).view(b, heads * d)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask,
                                         enable_gqa=heads != kv_heads, scale=opts.scale)  # [B, H, 1, D]
    return out.reshape(b, heads * d)
