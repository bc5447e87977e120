"""The persistent batch builds the same sampling metadata as the plain per-row reference builder."""

from __future__ import annotations

import torch

from lmserve.sample import SamplingRow, build_sampling_metadata
from lmserve.sample.sampler import process_logits
from lmserve.sampling_params import SamplingParams
from lmserve.sched.output import NewRequestData
from lmserve.worker.input_batch import InputBatch
from lmserve.worker.upload import to_device

V = 50
PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=3),
          SamplingParams(top_p=0.8, min_p=0.1, logprobs=2), SamplingParams(repetition_penalty=1.2, min_tokens=4),
          SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3, logit_bias={7: 2.0, 9: -1.0}),
          SamplingParams(temperature=1.3, top_k=3, top_p=0.9)]


def test_persistent_rows_equal_the_reference_metadata():
    prompts = [[1, 2, 3 + i] for i in range(len(PARAMS))]
    outputs = [[4, 4, 5][:i % 4] for i in range(len(PARAMS))]
    batch = InputBatch(V, torch.device("cpu"), capacity=2)  # grows while rows are added
    for i, p in enumerate(PARAMS):
        batch.add(NewRequestData(str(i), prompts[i], [], p, frozenset({0, 1}), p.seed))
    for i in range(len(PARAMS)):
        batch.accept(str(i), outputs[i])  # counts grow by accepted tokens only
    order = ["3", "0", "5", "1", "4", "2"]
    meta, gather, pending = to_device((*batch.metadata(order, [[]] * len(order)), batch.take_pending()), "cpu")
    batch.apply_pending(pending)
    batch.attach_counts(meta, gather)
    rows = [SamplingRow(PARAMS[int(r)], prompts[int(r)], outputs[int(r)], None, frozenset({0, 1})) for r in order]
    ref = build_sampling_metadata(rows, V, torch.device("cpu"))
    for name in ("temperature", "greedy", "filter_rows", "top_k", "top_p", "min_p", "repetition", "frequency",
                 "presence", "bias_values"):
        a, b = getattr(meta, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b.to(a.dtype)), name
    for name in ("all_greedy", "all_random", "max_top_k", "max_num_logprobs"):
        assert getattr(meta, name) == getattr(ref, name), name
    for name in ("bias_index", "ban_index"):
        assert [t.tolist() for t in getattr(meta, name)] == [t.tolist() for t in getattr(ref, name)], name
    # counts are kept only for rows that use a penalty (elsewhere they multiply a neutral value)
    penalised = [0, 4]  # requests "3" and "4" in this order
    assert torch.equal(meta.output_counts[penalised], ref.output_counts[penalised])
    assert torch.equal(meta.prompt_seen[0], ref.prompt_seen[0])  # "3" uses the repetition penalty
    logits = torch.randn(len(order), V, generator=torch.Generator().manual_seed(0))
    assert torch.equal(process_logits(logits.clone(), meta), process_logits(logits.clone(), ref))
    assert [i for i, _ in meta.generators] == [3]  # the seeded sampling row, in this step's order
    batch.remove("3")
    batch.add(NewRequestData("6", [2], [], SamplingParams(frequency_penalty=1.0), frozenset(), None))
    assert batch.index["6"] == 3 and not batch.counts[3].any()  # a reused row starts with zero counts
