"""The persistent batch: one row per live request, kept across steps: its token ids, its KV block table and
its sampling state.

A row is made when the scheduler first sends a request (`NewRequestData`, whole) and dropped when it reports
the request finished; a preempted request keeps its row (its tokens, counts and RNG stay valid while it
waits; its block table is sent again from 0 when it resumes). Every step `apply` writes what each scheduled
request's row lacks (its new token ids, its new block ids: worker/block_table.py) and its drafts after its
known tokens; the step's flat inputs are then gathered from the rows (worker/inputs.py).

Per-row sampling parameters live in numpy columns; the output-token counts that penalties need live in one
[rows, V] device tensor that only grows by the tokens each step accepts (never rebuilt from a request's
history). `metadata` is the one builder of SamplingMetadata: it gathers the columns of the rows a step
samples, expanded to one entry per logits row (a verify step has 1 + k), as numpy arrays that travel to the
device with the step's other inputs. A tensor-parallel worker rank keeps the rows without sampling state
(`samples=False`): rank 0 samples for everyone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmserve.pooling_params import PoolingParams
from lmserve.sample.metadata import SamplingMetadata
from lmserve.sampling_params import SamplingParams
from lmserve.sched.output import NewRequestData, ScheduledRequest
from lmserve.worker.block_table import RowTable

_FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")
_INT_COLUMNS = ("top_k", "logprobs", "min_tokens", "num_output")


@dataclass
class PendingCounts:
    """Tokens accepted last step by rows that use penalties: added to the counts before the next sample."""

    rows: np.ndarray  # [M] int64 persistent rows
    tokens: np.ndarray  # [M] int64


@dataclass
class CountsGather:
    """How the step's expanded rows read the persistent counts (numpy until uploaded)."""

    rows: np.ndarray  # [N] int64 persistent row of each logits row
    extra_rows: np.ndarray  # [E] logits rows that also count earlier drafts of their own verify run
    extra_tokens: np.ndarray  # [E]


class InputBatch:
    """Rows of the live requests (tokens, block table, sampling state), indexed by request id."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64, samples: bool = True,
                 num_kv_groups: int = 1) -> None:
        self.vocab, self.device, self.samples = vocab_size, torch.device(device), samples
        self.index: dict[str, int] = {}
        self.tokens = RowTable(0)  # [rows, >= tokens] prompt + output ids (+ this step's drafts past them)
        # [rows, >= blocks] the KV block table of each KV group (cache/kv_groups.py); `blocks` is the first's
        self.group_blocks = [RowTable(0) for _ in range(num_kv_groups)]
        self.blocks = self.group_blocks[0]
        self._free: list[int] = []
        self.capacity = 0
        self.cols: dict[str, np.ndarray] = {}
        self.greedy = np.zeros(0, dtype=bool)
        self.params: list[SamplingParams | None] = []
        self.stop_ids: list[frozenset[int]] = []
        self.generators: list[torch.Generator | None] = []
        self.counts: torch.Tensor | None = None  # [capacity, V] float32, rows that use penalties only
        self.prompt_seen: torch.Tensor | None = None  # [capacity, V] bool, rows with a repetition penalty
        self._pending: list[tuple[int, int]] = []
        self._grow(capacity)

    # -- rows -------------------------------------------------------------------------------------

    def add(self, new: NewRequestData) -> None:
        """Create the row of a request the runner has not seen."""
        if not self._free:
            self._grow(2 * self.capacity)
        row = self._free.pop()
        self.index[new.request_id] = row
        p = new.params
        c = self.cols
        c["temperature"][row] = 1.0 if p.greedy else p.temperature
        self.greedy[row] = p.greedy
        k = p.top_k if not p.greedy and 0 < p.top_k < self.vocab else self.vocab
        c["top_k"][row], c["top_p"][row] = k, (1.0 if p.greedy else p.top_p)
        c["min_p"][row] = 0.0 if p.greedy else p.min_p
        c["repetition"][row], c["frequency"][row] = p.repetition_penalty, p.frequency_penalty
        c["presence"][row] = p.presence_penalty
        c["logprobs"][row] = -1 if p.logprobs is None else p.logprobs
        c["min_tokens"][row], c["num_output"][row] = p.min_tokens, len(new.output_token_ids)
        self.params[row], self.stop_ids[row] = p, new.stop_token_ids
        self.tokens.write(row, 0, new.prompt_token_ids + new.output_token_ids)
        for table in self.group_blocks:
            table.clear(row)
        if self.samples:
            self.generators[row] = _generator(new.seed, self.device)
            self._init_counts(row, p, new)

    def pooling_of(self, request_id: str) -> PoolingParams:
        """A pooling request's PoolingParams (its row's params say pool)."""
        return self.params[self.index[request_id]].pooling

    def remove(self, request_id: str) -> None:
        """Drop a finished request's row (unknown ids are ignored: it may never have been scheduled)."""
        row = self.index.pop(request_id, None)
        if row is None:
            return
        self.params[row], self.generators[row] = None, None
        self._pending = [(r, t) for r, t in self._pending if r != row]
        self._free.append(row)

    def apply(self, scheduled: list[ScheduledRequest]) -> None:
        """Write what each scheduled request's row lacks: new token ids, new block ids, this step's drafts."""
        for s in scheduled:
            row = self.index[s.request_id]
            if s.new_token_ids:
                self.tokens.write(row, s.token_start, s.new_token_ids)
            if s.new_block_ids or s.block_start < self.blocks.lens[row]:
                n = len(s.new_block_ids) // len(self.group_blocks)  # as many for each group, group after group
                for g, table in enumerate(self.group_blocks):
                    table.write(row, s.block_start, s.new_block_ids[g * n:(g + 1) * n])
            if s.spec_token_ids:  # read as input ids at their positions; cut by the next step's new tokens
                self.tokens.write(row, s.start_pos + s.num_known, s.spec_token_ids)

    def accept(self, request_id: str, tokens: list[int]) -> None:
        """Record tokens the step sampled for a row (min_tokens progress and penalty counts)."""
        row = self.index[request_id]
        self.cols["num_output"][row] += len(tokens)
        if _uses_penalty(self.params[row]):
            self._pending.extend((row, t) for t in tokens)

    def _init_counts(self, row: int, p: SamplingParams, new: NewRequestData) -> None:
        if not _uses_penalty(p):
            return
        if self.counts is None:
            self.counts = torch.zeros(self.capacity, self.vocab, dtype=torch.float32, device=self.device)
        self.counts[row].zero_()
        if new.output_token_ids:  # a request that already has output (rare): count it once, here
            self._pending.extend((row, t) for t in new.output_token_ids)
        if p.repetition_penalty != 1.0:
            if self.prompt_seen is None:
                self.prompt_seen = torch.zeros(self.capacity, self.vocab, dtype=torch.bool, device=self.device)
            self.prompt_seen[row].zero_()
            self.prompt_seen[row, torch.as_tensor(new.prompt_token_ids, device=self.device)] = True

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        self._free.extend(range(capacity - 1, old - 1, -1))
        for name in _FLOAT_COLUMNS:
            self.cols[name] = np.resize(self.cols.get(name, np.zeros(0, np.float32)), capacity).astype(np.float32)
        for name in _INT_COLUMNS:
            self.cols[name] = np.resize(self.cols.get(name, np.zeros(0, np.int64)), capacity).astype(np.int64)
        self.greedy = np.resize(self.greedy, capacity)
        self.tokens.grow_rows(capacity)
        for table in self.group_blocks:
            table.grow_rows(capacity)
        for lst, fill in ((self.params, None), (self.stop_ids, frozenset()), (self.generators, None)):
            lst.extend([fill] * (capacity - old))
        for name in ("counts", "prompt_seen"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t, t.new_zeros(capacity - old, self.vocab)]))
        self.capacity = capacity

    # -- per step ---------------------------------------------------------------------------------

    def take_pending(self) -> PendingCounts | None:
        """Last step's accepted tokens of penalty rows, to add to the counts (numpy until uploaded)."""
        if not self._pending:
            return None
        rows, toks = zip(*self._pending)
        self._pending = []
        return PendingCounts(np.asarray(rows, dtype=np.int64), np.asarray(toks, dtype=np.int64))

    def apply_pending(self, pending: PendingCounts | None) -> None:
        """Add uploaded pending counts (one scatter on the device)."""
        if pending is not None and self.counts is not None:
            self.counts.index_put_((pending.rows, pending.tokens),
                                   torch.ones(pending.rows.shape[0], device=self.device), accumulate=True)

    def metadata(self, request_ids: list[str], drafts: list[list[int]], stop_bans: list[list[int]] | None = None
                 ) -> tuple[SamplingMetadata, CountsGather | None]:
        """Sampling metadata (numpy) for these requests, one entry per logits row: 1 + len(drafts[i]) each.
        `stop_bans`: per request, which of its rows mask its stop tokens besides min_tokens' (a reasoning budget)."""
        rows = np.fromiter((self.index[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        m = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        idx = np.repeat(rows, m)  # [N] persistent row of each logits row
        step = np.arange(len(idx)) - np.repeat(np.cumsum(m) - m, m)  # [N] position within its verify run
        c = {name: col[idx] for name, col in self.cols.items()}
        greedy = self.greedy[idx]
        meta = SamplingMetadata(
            temperature=c["temperature"], greedy=greedy, all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()), **self._filters(c), min_p=_used(c["min_p"], c["min_p"] > 0),
            **self._penalty_columns(c), output_counts=None, prompt_seen=None,
            **self._bias(idx), ban_index=self._min_tokens_ban(idx, c, step, _ban_rows(m, stop_bans)),
            generators=[(i, self.generators[r]) for i, r in enumerate(idx.tolist())
                        if self.generators[r] is not None and not self.greedy[r]],
            max_num_logprobs=int(c["logprobs"].max()) if (c["logprobs"] >= 0).any() else None,
            draft_ids=_draft_ids(drafts, m) if any(drafts) else None)
        uses = any(_uses_penalty(self.params[r]) for r in rows.tolist())
        return meta, (_counts_gather(idx, drafts, m) if uses else None)

    def attach_counts(self, meta: SamplingMetadata, gather: CountsGather | None) -> None:
        """Fill output_counts / prompt_seen from the persistent tensors (after upload; device ops only)."""
        if gather is None:
            return
        counts = self.counts.index_select(0, gather.rows)  # [N, V]
        if gather.extra_rows.shape[0]:
            counts.index_put_((gather.extra_rows, gather.extra_tokens),
                              torch.ones(gather.extra_rows.shape[0], device=self.device), accumulate=True)
        meta.output_counts = counts
        if meta.repetition is not None:
            meta.prompt_seen = self.prompt_seen.index_select(0, gather.rows)

    def _filters(self, c: dict[str, np.ndarray]) -> dict:
        ks, tps = c["top_k"], c["top_p"]
        use = (ks < self.vocab) | (tps < 1.0)
        rows = np.flatnonzero(use)
        any_k, any_p = bool((ks[rows] < self.vocab).any()), bool((tps[rows] < 1.0).any())
        return {"filter_rows": rows if 0 < len(rows) < len(ks) else None,
                "top_k": ks[rows] if any_k else None,
                "max_top_k": int(ks[rows].max()) if any_k else 0,
                "top_p": tps[rows] if any_p else None}

    @staticmethod
    def _penalty_columns(c: dict[str, np.ndarray]) -> dict:
        def column(name: str, neutral: float) -> np.ndarray | None:
            v = c[name]
            return v[:, None] if (v != neutral).any() else None
        return {"repetition": column("repetition", 1.0), "frequency": column("frequency", 0.0),
                "presence": column("presence", 0.0)}

    def _bias(self, idx: np.ndarray) -> dict:
        entries = [(i, tok, b) for i, r in enumerate(idx.tolist())
                   for tok, b in (self.params[r].logit_bias or {}).items()]
        if not entries:
            return {"bias_index": None, "bias_values": None}
        r, t, v = (np.asarray(x) for x in zip(*entries))
        return {"bias_index": (r.astype(np.int64), t.astype(np.int64)), "bias_values": v.astype(np.float32)}

    def _min_tokens_ban(self, idx: np.ndarray, c: dict[str, np.ndarray], step: np.ndarray, extra: list[int]):
        short = np.flatnonzero(c["num_output"] + step < c["min_tokens"])
        if extra:
            short = np.union1d(short, np.asarray(extra, dtype=np.int64))
        entries = [(int(i), tok) for i in short for tok in self.stop_ids[int(idx[i])] if tok < self.vocab]
        if not entries:
            return None
        r, t = zip(*entries)
        return np.asarray(r, dtype=np.int64), np.asarray(t, dtype=np.int64)


def _ban_rows(m: np.ndarray, stop_bans: list[list[int]] | None) -> list[int]:
    """The logits rows of `stop_bans` (offsets within each request's 1 + drafts rows)."""
    if not stop_bans or not any(stop_bans):
        return []
    starts = (np.cumsum(m) - m).tolist()
    return [starts[k] + j for k, offsets in enumerate(stop_bans) for j in offsets]


def _used(values: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    return values if mask.any() else None


def _uses_penalty(p: SamplingParams | None) -> bool:
    return p is not None and (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                              or p.presence_penalty != 0.0)


def _draft_ids(drafts: list[list[int]], m: np.ndarray) -> np.ndarray:
    """[N] the draft token each logits row verifies (-1 on each run's last row: it samples freely)."""
    out = np.full(int(m.sum()), -1, dtype=np.int64)
    start = 0
    for d, n in zip(drafts, m.tolist()):
        out[start:start + len(d)] = d
        start += n
    return out


def _counts_gather(idx: np.ndarray, drafts: list[list[int]], m: np.ndarray) -> CountsGather:
    """Logits row j of a verify run also counts the drafts before it (they precede it in the sequence)."""
    extra_r, extra_t, start = [], [], 0
    for d, n in zip(drafts, m.tolist()):
        for j in range(1, n):
            extra_r.extend([start + j] * j)
            extra_t.extend(d[:j])
        start += n
    return CountsGather(idx, np.asarray(extra_r, dtype=np.int64), np.asarray(extra_t, dtype=np.int64))


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """The completion's own RNG: its draws depend only on its seed and its own history."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**63)
    return gen
