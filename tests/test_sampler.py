"""The sampler on fixed logits: chi-square fits for the sampling filters, exact greedy, seeds,
penalties, bias, min_tokens, grammar masks and logprobs against hand-computed references.

Metadata comes from the runner's persistent batch (tests/sampling_rows.py), the engine's one builder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lmserve.sample.sampler as sampler_module
from lmserve.sample import Sampler
from lmserve.sample.filters import top_k_only, top_k_top_p
from lmserve.sample.sampler import process_logits
from lmserve.sampling_params import SamplingParams
from tests.sampling_rows import Rows, metadata

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])  # distinct: no ties in rank order
N = 20000
INF = float("inf")


def run(params, logits, **kw):
    return Sampler()(logits, metadata(params, logits.shape[-1], **kw))


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The target distribution, computed independently in float64: temperature -> top-k -> top-p -> min-p."""
    x = LOGITS.numpy().astype(np.float64) / temperature
    order = np.argsort(-x)
    keep = np.ones(V, bool)
    if top_k:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        cum = 0.0
        for i in order:  # keep the smallest prefix in rank order whose mass reaches top_p
            keep[i] = keep[i] and cum < top_p
            cum += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value over the tokens with non-zero expected probability."""
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the filters removed"
    exp = probs[support] * counts.sum()
    assert exp.min() >= 5, "too few expected samples per token for the chi-square approximation"
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    # chi2.sf(stat, dof) is the regularised upper incomplete gamma Q(dof / 2, stat / 2).
    q = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    return float(q)


def sample_counts(params: SamplingParams, n: int = N) -> np.ndarray:
    torch.manual_seed(0)
    out = run([params] * n, LOGITS.expand(n, -1))
    return np.bincount(out.sampled_token_ids.numpy(), minlength=V)


CASES = [dict(temperature=0.7), dict(temperature=1.5), dict(top_k=3), dict(top_p=0.8), dict(min_p=0.2),
         dict(temperature=0.8, top_k=5, top_p=0.9), dict(temperature=1.3, top_k=6, top_p=0.95, min_p=0.05),
         dict(top_p=0.9, min_p=0.1)]  # keeps token 4; min-p before top-p would drop it


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampling_distribution_matches(kw):
    counts = sample_counts(SamplingParams(**kw))
    assert chi_square_p(counts, expected(**kw)) > 1e-3, (counts, expected(**kw) * N)


def test_chi_square_detects_a_wrong_distribution():
    counts = sample_counts(SamplingParams(temperature=0.7))
    assert chi_square_p(counts, expected(temperature=1.0)) < 1e-6


def test_mixed_batch_each_row_group_follows_its_own_distribution():
    """Greedy, top-k-only, top-p and plain rows interleaved: the filters only touch their own rows."""
    groups = [dict(temperature=0.0), dict(top_k=3), dict(temperature=0.8, top_p=0.8), dict(temperature=1.5)]
    params = [SamplingParams(**groups[i % 4]) for i in range(4 * N // 2)]
    torch.manual_seed(1)
    ids = run(params, LOGITS.expand(len(params), -1)).sampled_token_ids.numpy()
    assert (ids[0::4] == 0).all()
    for g in range(1, 4):
        kw = {k: v for k, v in groups[g].items()}
        assert chi_square_p(np.bincount(ids[g::4], minlength=V), expected(**kw)) > 1e-3, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_exact_argmax_in_a_mixed_batch(dtype):
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)] * 4
    out = run(params, logits)
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids.shape == (8,)
    assert torch.equal(out.sampled_token_ids[::2], logits.float().argmax(-1)[::2])
    assert out.top_logprobs is None and out.top_logprob_ids is None  # nobody asked for alternatives
    # the chosen token's logprob is always there (monitoring's mean output logprob uses it)
    expected = logits.float().log_softmax(-1).gather(1, out.sampled_token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected, rtol=1e-5, atol=1e-5)
    assert out.sampled_token_ids.max() < 50


def test_top_k_fast_path_equals_sort_path_with_ties():
    x = (torch.randn(64, 300, generator=torch.Generator().manual_seed(2)) * 2).round()  # many ties
    k = torch.randint(1, 300, (64,), generator=torch.Generator().manual_seed(3))
    fast = top_k_only(x, k, int(k.max()))
    assert torch.equal(fast, top_k_top_p(x, k, None))
    kept = (fast > -INF).sum(-1)
    assert (kept >= k).all()  # ties with the k-th logit are kept, never fewer than k


def test_top_p_one_never_cuts_the_tail():
    x = torch.randn(4, 50000, generator=torch.Generator().manual_seed(4))
    out = top_k_top_p(x, None, torch.ones(4))
    assert torch.equal(out, x)


# -- seeds ---------------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, frequency_penalty=0.3, seed=42)


def row_logits(step: int) -> torch.Tensor:
    return torch.randn(200, generator=torch.Generator().manual_seed(1000 + step))


def seeded_run(batch: list[SamplingParams], targets: list[int], global_seed: int, steps: int = 15) -> list[list[int]]:
    """Drive `batch` for `steps` steps; rows in `targets` see row_logits(step), the rest random logits.

    The rows persist across steps as the runner keeps them: each keeps its own seeded RNG and its counts."""
    rows = Rows(batch, 200)
    outputs: list[list[int]] = [[] for _ in batch]
    torch.manual_seed(global_seed)  # the global RNG state differs between runs
    for step in range(steps):
        logits = torch.randn(len(batch), 200)
        logits[targets] = row_logits(step)
        sampled = Sampler()(logits, rows.metadata()).sampled_token_ids.tolist()
        rows.accept([[tok] for tok in sampled])
        for out, tok in zip(outputs, sampled):
            out.append(tok)
    return [outputs[t] for t in targets]


def test_seeded_rows_ignore_the_rest_of_the_batch():
    (alone,) = seeded_run([SEEDED], [0], global_seed=0)
    crowd = [SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=1.0, seed=7),
             SamplingParams(temperature=0.0), SEEDED, SamplingParams(temperature=1.2, min_p=0.1)]
    (crowded,) = seeded_run(crowd, [3], global_seed=1)
    twins = seeded_run([SEEDED, SamplingParams(top_k=3), SEEDED], [0, 2], global_seed=2)
    assert len(set(alone)) > 3  # really sampling, not collapsing to one token
    assert crowded == alone
    assert twins == [alone, alone]  # two requests with the same seed get the same tokens


def test_different_seeds_differ():
    (a,) = seeded_run([SEEDED], [0], global_seed=0)
    (b,) = seeded_run([SamplingParams(temperature=0.9, top_k=40, top_p=0.95, frequency_penalty=0.3, seed=43)],
                      [0], global_seed=0)
    assert a != b


def test_unseeded_rows_follow_the_global_rng():
    p = [SamplingParams(temperature=1.0)] * 64
    logits = torch.zeros(64, 100)
    torch.manual_seed(5)
    a = run(p, logits).sampled_token_ids
    torch.manual_seed(5)
    assert torch.equal(a, run(p, logits).sampled_token_ids)
    assert not torch.equal(a, run(p, logits).sampled_token_ids)


# -- penalties, bias, min_tokens, grammar masks ---------------------------------------------------------

def processed(params, outputs=None, prompts=None, stop_ids=frozenset(), logits=LOGITS) -> torch.Tensor:
    """The logits after bias, ban, grammar masks and penalties (the input to logprobs and sampling)."""
    meta = metadata(params, V, outputs=outputs, prompts=prompts, stop_ids=stop_ids)
    return process_logits(logits.expand(len(params), -1).clone(), meta)


def only_token(token: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A grammar bitmask allowing just `token` on logits rows `rows`, as the runner hands it to the sampler:
    ([G, ceil(V / 32)] int32, bit t % 32 of word t // 32; [G] int64 rows)."""
    mask = torch.zeros(len(rows), -(-V // 32), dtype=torch.int32)
    mask[:, token // 32] = 1 << (token % 32)
    return mask, torch.tensor(rows, dtype=torch.int64)


def test_penalties_change_exactly_the_expected_logits():
    prompt, output = [1, 6, 6], [2, 3, 3, 7]  # 6 and 7 have negative logits: multiplied, not divided
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=0.5),
              SamplingParams(presence_penalty=-0.25),
              SamplingParams(repetition_penalty=1.5, frequency_penalty=-1.0, presence_penalty=0.75)]
    got = processed(params, outputs=[output] * 5, prompts=[prompt] * 5)
    counts = {2: 1, 3: 2, 7: 1}  # output only
    for row, p in enumerate(params):
        ref = LOGITS.tolist()
        for t in set(prompt) | set(output):
            r = p.repetition_penalty
            ref[t] = ref[t] / r if ref[t] > 0 else ref[t] * r
        for t, c in counts.items():
            ref[t] -= p.frequency_penalty * c + p.presence_penalty
        assert torch.allclose(got[row], torch.tensor(ref), atol=1e-6, rtol=0), (row, got[row], ref)
    assert torch.equal(got[0], LOGITS)
    assert torch.equal(got[1][[0, 4, 5]], LOGITS[[0, 4, 5]])  # unseen tokens untouched


def test_penalties_steer_greedy_and_logprobs():
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                       logprobs=V)
    out = run([p], LOGITS[None].clone(), outputs=[[0, 0, 2]], prompts=[[1]])
    ref = LOGITS.clone()
    ref[0], ref[1], ref[2] = 2.0 / 2 - 0.5 * 2 - 0.25, 1.5 / 2, 1.0 / 2 - 0.5 - 0.25
    lp = torch.log_softmax(ref, -1)
    assert out.sampled_token_ids.tolist() == [int(ref.argmax())] == [1]  # penalties moved argmax off token 0
    assert torch.allclose(out.top_logprobs[0], lp[out.top_logprob_ids[0]], atol=1e-6)
    assert sorted(out.top_logprob_ids[0].tolist()) == list(range(V))
    assert torch.allclose(out.logprobs, lp[1:2], atol=1e-6)


def test_logit_bias_touches_only_its_row_and_tokens():
    params = [SamplingParams(temperature=0.0, logit_bias={5: 10.0, 0: -100.0}), SamplingParams(temperature=0.0)]
    got = processed(params)
    ref = LOGITS.clone()
    ref[5] += 10.0
    ref[0] -= 100.0
    assert torch.equal(got[0], ref) and torch.equal(got[1], LOGITS)
    assert run(params, LOGITS.expand(2, -1)).sampled_token_ids.tolist() == [5, 0]


def test_min_tokens_masks_stop_ids_until_reached():
    ban = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4)
    stop = frozenset({0, 3, 10**6})  # an id past the vocabulary is ignored, not an error
    for generated, masked in (([], True), ([9], True), ([9, 9], False), ([9, 9, 9], False)):
        got = processed([ban, SamplingParams()], outputs=[generated, []], stop_ids=stop)
        ref = LOGITS.clone()
        if masked:
            ref[[0, 3]] = -INF
        assert torch.equal(got[0], ref) and torch.equal(got[1], LOGITS)  # the other row has no min_tokens
        out = run([ban], LOGITS[None], outputs=[generated], stop_ids=stop)
        assert out.sampled_token_ids.tolist() == [1 if masked else 0]


def test_min_tokens_sampling_rows_never_draw_a_stop_id():
    torch.manual_seed(0)
    params = [SamplingParams(min_tokens=1, temperature=2.0)] * 4000
    ids = run(params, LOGITS.expand(4000, -1), stop_ids=frozenset({0, 1})).sampled_token_ids
    counts = torch.bincount(ids, minlength=V)
    assert counts[0] == 0 and counts[1] == 0 and (counts[2:] > 0).all()


def test_grammar_mask_runs_after_bias_and_ban_before_penalties(monkeypatch):
    seen = []
    apply_bitmask = sampler_module.apply_bitmask

    def spy(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        seen.append(logits[0].clone())  # what the mask step is given
        apply_bitmask(logits, bitmask, rows)

    monkeypatch.setattr(sampler_module, "apply_bitmask", spy)
    params = [SamplingParams(logit_bias={2: 1.0}, min_tokens=1, presence_penalty=0.5), SamplingParams()]
    meta = metadata(params, V, outputs=[[], [6]], stop_ids=frozenset({0}))
    meta.grammar_bitmask, meta.grammar_rows = only_token(6, [0])
    out = Sampler()(LOGITS.expand(2, -1), meta)
    ref = LOGITS.clone()
    ref[2] += 1.0
    ref[0] = -INF
    assert len(seen) == 1 and torch.equal(seen[0], ref)
    assert out.sampled_token_ids[0] == 6


def test_grammar_mask_rows_alone_are_constrained():
    meta = metadata([SamplingParams()] * 200, V)
    meta.grammar_bitmask, meta.grammar_rows = only_token(6, list(range(0, 200, 2)))
    torch.manual_seed(0)
    ids = Sampler()(LOGITS.expand(200, -1), meta).sampled_token_ids
    assert (ids[::2] == 6).all() and (ids[1::2] != 6).any()


# -- logprobs -----------------------------------------------------------------------------------------

def test_logprobs_k_is_the_batch_max_and_values_exact():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.5),
              SamplingParams(temperature=1.5, top_k=3, logprobs=5, logit_bias={7: 3.0}),
              SamplingParams(temperature=0.0, logprobs=0)]
    torch.manual_seed(0)
    out = run(params, logits)
    biased = logits.clone()
    biased[2, 7] += 3.0
    lp = torch.log_softmax(biased, -1)  # pre-temperature, pre-filter: temperature and top-k don't change it
    assert out.top_logprobs.shape == out.top_logprob_ids.shape == (4, 5)
    assert out.top_logprob_ids.dtype == torch.int64 and out.top_logprobs.dtype == torch.float32
    assert torch.allclose(out.top_logprobs, lp.topk(5).values, atol=1e-6)
    assert torch.equal(out.top_logprob_ids, lp.topk(5).indices)
    assert torch.allclose(out.logprobs, lp.gather(1, out.sampled_token_ids[:, None])[:, 0], atol=1e-6)


def test_logprobs_zero_gives_only_the_chosen_token():
    out = run([SamplingParams(temperature=0.0, logprobs=0)] * 2, LOGITS.expand(2, -1))
    assert out.top_logprobs.shape == (2, 0) and out.top_logprob_ids.shape == (2, 0)
    assert torch.allclose(out.logprobs, torch.log_softmax(LOGITS, -1)[0].expand(2))


def test_banned_tokens_have_minus_inf_logprob():
    p = SamplingParams(temperature=0.0, min_tokens=1, logprobs=V)
    out = run([p], LOGITS[None], stop_ids=frozenset({0}))
    assert out.top_logprob_ids[0, -1] == 0 and out.top_logprobs[0, -1] == -INF


# -- metadata flags -------------------------------------------------------------------------------------

def test_metadata_flags_computed_once_from_params():
    def meta(*params):
        return metadata(list(params), V)

    m = meta(SamplingParams(temperature=0.0, top_k=3, min_p=0.5, logprobs=1), SamplingParams(temperature=0.0))
    assert m.all_greedy and not m.all_random
    assert m.no_top_k and m.no_top_p and m.no_min_p and m.no_penalties  # filters are moot on greedy rows
    assert m.max_num_logprobs == 1 and not m.writes_logits
    m = meta(SamplingParams(top_k=3), SamplingParams(top_p=0.5, logprobs=4), SamplingParams(logprobs=2))
    assert m.all_random and not m.all_greedy and not m.no_top_k and not m.no_top_p
    assert m.filter_rows.tolist() == [0, 1] and m.top_k.tolist() == [3, V] and m.max_top_k == V
    assert m.top_p.tolist() == [1.0, 0.5] and m.max_num_logprobs == 4
    m = meta(SamplingParams(top_k=V + 5, top_p=0.9), SamplingParams(top_k=2))  # k >= V is off
    assert m.filter_rows is None and m.top_k.tolist() == [V, 2]  # every row filters: no gather
    assert m.top_p.tolist() == pytest.approx([0.9, 1.0]) and m.max_top_k == V
    m = meta(SamplingParams(presence_penalty=0.1), SamplingParams(logit_bias={1: 1.0}))
    assert not m.no_penalties and m.repetition is None and m.prompt_seen is None and m.writes_logits


def test_native_greedy_argmax_and_logprob_equal_the_reference():
    """The all-greedy, no-logprobs step's native pass pair (argmax + its log-softmax) against torch's: first index
    on ties, a large vocabulary with a ragged tail, and torch's answers for NaN, +inf and all -inf rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 70001, generator=g) * 4
    logits[1, [5, 900, 70000]] = 50.0  # a three-way tie: the first index wins
    logits[2, -1] = 60.0  # the maximum in the masked tail
    logits[3, 1234] = float("nan")
    logits[4, 10] = INF
    logits[5] = -INF
    logits[6, :] = 0.0  # all equal: index 0, log(1 / V)
    ids, lp = sampler_module.argmax_with_logprob(logits)
    ref_ids, ref_lp = sampler_module.argmax_with_logprob_ref(logits)
    assert torch.equal(ids, ref_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5, equal_nan=True)
    out = run([SamplingParams(temperature=0.0)] * 3, logits[:3])  # the sampler takes the pair on an all-greedy batch
    assert torch.equal(out.sampled_token_ids, ref_ids[:3]) and out.top_logprobs is None
    torch.testing.assert_close(out.logprobs, ref_lp[:3], rtol=1e-5, atol=1e-5)
