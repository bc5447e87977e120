"""Pooling requests' vectors from the step's final hidden states (after the model's final norm).

A pooling request's prompt may run in several chunks (chunked prefill), and from position 0 again after a
preemption. Per request the runner keeps what its model's method needs so far: nothing for last-token, the
first token's hidden state for CLS, a float32 running sum for mean, a running maximum for max. When the prompt's
last chunk has run (`sample` on its ScheduledRequest) the vector is finished (pooled, cut to `dimensions`,
L2-normalised) and all of the step's vectors are downloaded with one copy. A model with a classification head
(an encoder's `score`) turns the pooled CLS vector into its labels' scores instead: sigmoid for one label (a
cross-encoder's relevance, as sentence-transformers' CrossEncoder), softmax over several (vLLM's classify).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from lmserve.pooling_params import PoolerConfig, PoolingParams
from lmserve.sched.output import SchedulerOutput


class Pooler:
    """The model's pooling method, applied to the pooling requests of each step."""

    def __init__(self, cfg: PoolerConfig, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`head`: the model's classification head, CLS vectors [N, H] -> logits [N, labels] (None: an embedder)."""
        self.method, self.head = cfg.method, head
        self._acc: dict[str, torch.Tensor] = {}  # request id -> [hidden] float32: mean's running sum, CLS's token 0

    def drop(self, request_ids: list[str]) -> None:
        """Forget requests that ended (an abort mid-prompt leaves a partial sum)."""
        for rid in request_ids:
            self._acc.pop(rid, None)

    def __call__(self, out: SchedulerOutput, pool: list[tuple[int, int]], hidden: torch.Tensor,
                 params_of: Callable[[str], PoolingParams]) -> dict[str, list[float]]:
        """`pool`: (scheduler-order index, first flat row) of each pooling request; hidden [T, H]. Returns the
        vectors of the requests whose prompt ended this step."""
        ids, vecs = [], []
        for i, first in pool:
            s = out.requests[i]
            vec = self._step(s.request_id, s.start_pos, hidden[first:first + s.num_known], s.sample)  # [H]
            if vec is not None:
                ids.append(s.request_id)
                vecs.append(self._finish(vec, params_of(s.request_id)))
        if not vecs:
            return {}
        flat = torch.cat(vecs).tolist()  # one download for the step
        res, start = {}, 0
        for rid, v in zip(ids, vecs):
            res[rid] = flat[start:start + v.shape[0]]
            start += v.shape[0]
        return res

    def _step(self, rid: str, start_pos: int, rows: torch.Tensor, last: bool) -> torch.Tensor | None:
        """Fold one chunk's rows [n, H] in; the pooled [H] vector once the prompt's last chunk is in."""
        if self.method == "last":
            return rows[-1].float() if last else None
        if self.method == "cls":
            if start_pos == 0:
                self._acc[rid] = rows[0].float()
        elif self.method == "max":  # per dimension, over the prompt
            part = rows.float().amax(dim=0)
            self._acc[rid] = part if start_pos == 0 else torch.maximum(self._acc[rid], part)
        else:  # mean: a float32 sum over the prompt; position 0 (again, after a preemption) starts it over
            part = rows.float().sum(dim=0)
            self._acc[rid] = part if start_pos == 0 else self._acc[rid] + part
        if not last:
            return None
        acc = self._acc.pop(rid)
        return acc / (start_pos + rows.shape[0]) if self.method == "mean" else acc


    def _finish(self, vec: torch.Tensor, p: PoolingParams) -> torch.Tensor:
        """A classifier's activated label scores, else the vector as `_cut` finishes it."""
        if self.head is None:
            return _cut(vec, p)
        logits = self.head(vec[None])[0].float()  # [labels]
        return logits.sigmoid() if logits.shape[0] == 1 else logits.softmax(dim=0)


def _cut(vec: torch.Tensor, p: PoolingParams) -> torch.Tensor:
    """Keep the first `dimensions` components, then scale to unit length (as sentence-transformers' Normalize)."""
    if p.dimensions is not None:
        vec = vec[:p.dimensions]
    return F.normalize(vec, dim=0) if p.normalize else vec


def token_pair_head(compute_logits: Callable[[torch.Tensor], torch.Tensor], false_id: int, true_id: int,
                    dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A decoder's last-token logits read as a one-label classifier (Qwen3-Reranker, vLLM's classifier_from_token):
    logit(true) - logit(false), whose sigmoid (`_finish`) is the softmax over the pair taken at `true`."""
    def head(vec: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(vec.to(dtype)).float()  # [N, vocab]: through the model's own lm_head, any format
        return (logits[:, true_id] - logits[:, false_id])[:, None]
    return head
