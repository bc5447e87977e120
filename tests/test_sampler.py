"""The sampler on fixed logits: exact greedy/penalties/logprobs, chi-square fits for the sampling filters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmserve.sample import Sampler, SamplingRow, build_sampling_metadata
from lmserve.sampling_params import SamplingParams

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 20000


def rows(params: list[SamplingParams], outputs=None, prompts=None, gens=None, stop_ids=frozenset()):
    outputs = outputs or [[] for _ in params]
    prompts = prompts or [[] for _ in params]
    gens = gens or [None for _ in params]
    return [SamplingRow(p, pr, o, g, stop_ids) for p, pr, o, g in zip(params, prompts, outputs, gens)]


def sample(params: SamplingParams, n: int = N, logits: torch.Tensor = LOGITS) -> np.ndarray:
    torch.manual_seed(0)
    meta = build_sampling_metadata(rows([params] * n), V, torch.device("cpu"))
    out = Sampler()(logits.expand(n, -1), meta)
    return np.bincount(out.sampled_token_ids.numpy(), minlength=V)


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The target distribution computed independently with numpy, in the documented order."""
    x = LOGITS.numpy().astype(np.float64) / temperature
    order = np.argsort(-x)
    keep = np.ones(V, bool)
    if top_k:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        cum = 0.0
        for i in order:
            if cum >= top_p:
                keep[i] = False
            cum += p[i]
        p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value over the categories with non-zero expected probability."""
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the filters removed"
    exp = probs[support] * counts.sum()
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    from scipy.stats import chi2

    return float(chi2.sf(stat, dof))


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7), dict(temperature=1.5), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.2), dict(temperature=0.8, top_k=5, top_p=0.9), dict(temperature=1.3, top_k=6,
                                                                                        top_p=0.95, min_p=0.05)])
def test_sampling_distribution_matches(kw):
    counts = sample(SamplingParams(**kw))
    probs = expected(**kw)
    assert chi_square_p(counts, probs) > 1e-3, (counts, probs * N)


def test_chi_square_detects_a_wrong_distribution():
    counts = sample(SamplingParams(temperature=0.7))
    assert chi_square_p(counts, expected(temperature=1.0)) < 1e-6


def test_greedy_is_argmax_and_mixes_with_sampling():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    out = Sampler()(logits, build_sampling_metadata(rows(params), 50, torch.device("cpu")))
    assert out.sampled_token_ids[::2].tolist() == logits.argmax(-1)[::2].tolist()
    assert out.logprobs is None


def test_seeded_rows_ignore_their_neighbours():
    p = SamplingParams(temperature=1.0, seed=42)

    def draw(batch_params, row, steps=12):
        gens = [torch.Generator().manual_seed(bp.seed) if bp.seed is not None else None for bp in batch_params]
        seq = []
        for step in range(steps):
            torch.manual_seed(step * 31 + len(batch_params))  # the global RNG differs between runs
            logits = torch.randn(len(batch_params), 100, generator=torch.Generator().manual_seed(step))
            meta = build_sampling_metadata(rows(batch_params, gens=gens), 100, torch.device("cpu"))
            seq.append(int(Sampler()(logits, meta).sampled_token_ids[row]))
        return seq

    alone = draw([p], 0)
    crowded = draw([SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, seed=7), p,
                    SamplingParams(temperature=0.0)], 2)
    # Row logits differ by position, so compare against the same logits row: rebuild alone at row 2's logits.
    gens = [torch.Generator().manual_seed(42)]
    alone_same_logits = []
    for step in range(12):
        logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(step))[2:3]
        meta = build_sampling_metadata(rows([p], gens=gens), 100, torch.device("cpu"))
        alone_same_logits.append(int(Sampler()(logits, meta).sampled_token_ids[0]))
    assert crowded == alone_same_logits
    assert len(set(alone)) > 1


def test_penalties_change_exactly_the_expected_logits():
    prompt, output = [1, 2], [2, 3, 3]
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                       logprobs=V - 1)
    meta = build_sampling_metadata(rows([p], [output], [prompt]), V, torch.device("cpu"))
    out = Sampler()(LOGITS[None].clone(), meta)
    ref = LOGITS.clone()
    for t in {1, 2, 3}:  # seen in prompt or output: repetition penalty
        ref[t] = ref[t] / 2.0 if ref[t] > 0 else ref[t] * 2.0
    for t, c in {2: 1, 3: 2}.items():  # frequency and presence from the output only
        ref[t] -= 0.5 * c + 0.25
    lp = torch.log_softmax(ref, -1)
    assert torch.allclose(out.top_logprobs[0], lp.sort(descending=True).values[:V - 1], atol=1e-6)
    assert out.sampled_token_ids.item() == int(ref.argmax())
    assert math.isclose(out.logprobs.item(), float(lp.max()), abs_tol=1e-6)


def test_logit_bias_and_min_tokens_ban():
    p = SamplingParams(temperature=0.0, logit_bias={5: 10.0})
    meta = build_sampling_metadata(rows([p]), V, torch.device("cpu"))
    assert Sampler()(LOGITS[None], meta).sampled_token_ids.item() == 5
    ban = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4)
    for generated, expect in (([], 1), ([9], 1), ([9, 9], 0)):
        meta = build_sampling_metadata(rows([ban], [generated], stop_ids=frozenset({0})), V, torch.device("cpu"))
        assert Sampler()(LOGITS[None], meta).sampled_token_ids.item() == expect


def test_logprobs_k_is_the_batch_max_and_values_exact():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=5)]
    out = Sampler()(logits, build_sampling_metadata(rows(params), 30, torch.device("cpu")))
    lp = torch.log_softmax(logits, -1)
    assert out.top_logprobs.shape == (3, 5)
    assert torch.allclose(out.top_logprobs, lp.topk(5).values)
    assert torch.equal(out.top_logprob_ids, lp.topk(5).indices)
    assert torch.allclose(out.logprobs, lp.max(-1).values)


def test_logits_processor_hook():
    p = SamplingParams(temperature=1.0)
    allowed = torch.full((V,), float("-inf"))
    allowed[6] = 0.0
    r = rows([p] * 4)
    for row in r:
        row.logits_processor = lambda x: x + allowed
    out = Sampler()(LOGITS.expand(4, -1), build_sampling_metadata(r, V, torch.device("cpu")))
    assert out.sampled_token_ids.tolist() == [6, 6, 6, 6]
