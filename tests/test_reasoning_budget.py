"""ReasoningBudget (structured/reasoning_budget.py) step by step: what it counts, when it forces the end tag, and
that a row filled through drafts equals the row filled after accepting those drafts one by one (the reference)."""

from __future__ import annotations

import random

import torch
import xgrammar as xgr

from lmserve.structured.mask import reference_allowed
from lmserve.structured.reasoning_budget import ReasoningBudget

START, END, SEP, STOP, V = (5, 6), (7, 8, 9), (10,), 2, 64


def _budget(budget: int, open_in_prompt: bool = True) -> ReasoningBudget:
    return ReasoningBudget(START, END, budget, open_in_prompt, V, [STOP], SEP)


def _row(b: ReasoningBudget, drafts: list[int] = ()) -> list[torch.Tensor]:
    mask = xgr.allocate_token_bitmask(1 + len(drafts), V)
    b.fill(mask, 0, list(drafts))
    return list(reference_allowed(mask, V))


def _run(b: ReasoningBudget, rng: random.Random, n: int) -> list[int]:
    """n tokens sampled under the budget's own rows (uniform over what a row allows)."""
    out = []
    for _ in range(n):
        allowed = _row(b)[0].nonzero().flatten().tolist()
        t = rng.choice(allowed)
        b.accept(t)
        out.append(t)
    return out


def test_reasoning_closes_within_the_budget_then_the_separator_and_an_answer_follow():
    for budget in (0, 1, 3, 4, 10, 25):
        rng = random.Random(budget)
        b = _budget(budget)
        out = []
        while not b.answered:
            out += _run(b, rng, 1)
            assert STOP not in out  # stop masked until the answer's first token
        at = next(i for i in range(len(out)) if tuple(out[i - 2:i + 1]) == END) + 1
        assert at <= max(budget, len(END)), (budget, out)
        assert len(out) == at + len(SEP) + 1 and tuple(out[at:at + len(SEP)]) == SEP  # forced, then free


def test_counting_starts_at_the_outputs_start_tag_when_the_prompt_opened_none():
    b = ReasoningBudget.for_prompt([1, 2, 3], START, END, 5, V, [STOP], SEP)
    assert b.used is None and b.forced is None and b.draft_room() is None
    for t in (11, 12, *START):
        b.accept(t)
    assert b.used == len(START) and b.draft_room() == 0 and b.forced == END[0]
    assert ReasoningBudget.for_prompt([*START, 3], START, END, 5, V).used == 0
    assert ReasoningBudget.for_prompt([*START, 3, *END], START, END, 5, V).used is None


def test_a_models_own_end_tag_ends_the_watch_without_forcing():
    b = _budget(50)
    for t in (20, 21, *END):
        b.accept(t)
    assert b.done and b.forced is None and not b.answered and not _row(b)[0][STOP]
    b.accept(30)
    assert b.answered and _row(b)[0].all()


def test_rows_through_drafts_equal_rows_after_accepting_them():
    """The reference: each draft accepted on a copy, then that copy's next row alone."""
    rng = random.Random(0)
    for trial in range(200):
        b = _budget(rng.randrange(0, 12), open_in_prompt=rng.random() < 0.7)
        _run(b, rng, rng.randrange(0, 10))
        drafts = [rng.choice([*START, *END, *SEP, 20, 21, 22]) for _ in range(rng.randrange(0, 5))]
        rows = _row(b, drafts)
        ref = []
        for j in range(len(drafts) + 1):
            c = _budget(0)
            c.__dict__.update({k: (list(v) if isinstance(v, list) else v) for k, v in b.__dict__.items()})
            for t in drafts[:j]:
                c.accept(t)
            ref.append(_row(c)[0])
            if c.answered:
                break
        for got, want in zip(rows, ref):
            assert torch.equal(got, want), (trial, drafts)
        # what the scheduler sends instead of a bitmask row: the stop bans, and whether any row is forced
        forced, bans = b.rows(drafts)
        assert forced == any(int(r.sum()) == 1 for r in rows[:len(ref)])
        assert bans == [j for j, r in enumerate(rows[:len(ref)]) if not r[STOP] and int(r.sum()) > 1] or forced
