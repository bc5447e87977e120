"""Sampling metadata for tests, built the one way the engine builds it: rows of the runner's persistent batch
(worker/input_batch.InputBatch), uploaded as the runner uploads them (worker/upload.to_device)."""

from __future__ import annotations

from typing import Sequence

import torch

from lmserve.sample.metadata import SamplingMetadata
from lmserve.sampling_params import SamplingParams
from lmserve.sched.output import NewRequestData
from lmserve.worker.input_batch import InputBatch
from lmserve.worker.upload import to_device

CPU = torch.device("cpu")


class Rows:
    """One persistent row per SamplingParams (request ids "0", "1", ...), as the runner holds them."""

    def __init__(self, params: Sequence[SamplingParams], vocab: int, prompts: Sequence[list[int]] | None = None,
                 outputs: Sequence[list[int]] | None = None, stop_ids: frozenset[int] = frozenset()) -> None:
        """`outputs`: tokens each row has generated so far (accepted as a step would); each row's RNG is its
        params' seed's, as the engine gives a completion."""
        self.ids = [str(i) for i in range(len(params))]
        self.batch = InputBatch(vocab, CPU, capacity=max(len(params), 1))
        for rid, p, prompt in zip(self.ids, params, prompts or [[] for _ in params]):
            self.batch.add(NewRequestData(rid, list(prompt), [], p, stop_ids, p.seed))
        self.accept(outputs or [[] for _ in params])

    def accept(self, tokens: Sequence[list[int]]) -> None:
        """What each row's step kept (penalty counts and min_tokens progress grow by them)."""
        for rid, t in zip(self.ids, tokens):
            self.batch.accept(rid, list(t))

    def metadata(self) -> SamplingMetadata:
        """The step's metadata for every row, in row order (one logits row each)."""
        meta, gather, pending = to_device((*self.batch.metadata(self.ids, [[] for _ in self.ids]),
                                           self.batch.take_pending()), CPU)
        self.batch.apply_pending(pending)
        self.batch.attach_counts(meta, gather)
        return meta


def metadata(params: Sequence[SamplingParams], vocab: int, **kw) -> SamplingMetadata:
    """One step's metadata for fresh rows (see Rows for the keywords)."""
    return Rows(params, vocab, **kw).metadata()
