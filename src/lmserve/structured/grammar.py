"""One sequence's grammar state (an xgrammar matcher) and the batch's token bitmask.

Protocol (vLLM v1's): the scheduler fills each constrained row's allowed tokens into one bitmask
per step; with drafts it advances the matcher through them to fill one row per draft position and
rolls back; `Scheduler.update` advances the matcher by the tokens actually accepted. Drafts are cut
at the first token the grammar refuses before they are scheduled (that row could not be filled, and
the draft would be rejected anyway: its logit is -inf).

With a reasoning gate (a reasoning parser on the server, as vLLM does it), the grammar applies only after the
reasoning ends: until the end-of-reasoning tokens ("</think>") have been generated, rows are left all-allowed
and tokens do not reach the matcher; the token right after them is the grammar's first. Drafts may cross the
end: the rows after it are the matcher's, token by token, as without a gate.

With a `LimitSteer` (limit.py: JSON grammars), a request near max_tokens gets one-token rows that spell the
shortest valid completion; `terminated` once it is written, and `steered` tells the stop checker why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from lmserve.structured.limit import LimitSteer
from lmserve.structured.reasoning_budget import ReasoningBudget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReasoningGate:
    """Holds a grammar back until `end` (the end-of-reasoning token ids) has been generated; immutable."""

    end: tuple[int, ...]
    recent: tuple[int, ...] = ()  # the last len(end) - 1 tokens: a multi-token end may span steps

    def after(self, token: int) -> "ReasoningGate | None":
        """The gate after one more generated token; None once the reasoning has ended."""
        recent = (*self.recent, int(token))
        if recent[-len(self.end):] == self.end:
            return None
        return ReasoningGate(self.end, recent[len(recent) - len(self.end) + 1:] if len(self.end) > 1 else ())

    @classmethod
    def for_prompt(cls, prompt: Sequence[int], start: Sequence[int], end: Sequence[int]) -> "ReasoningGate | None":
        """The gate of a request: None (the grammar applies at once) when the prompt's last reasoning tag is the
        end tag (a template that closed the reasoning itself: Qwen3 with thinking off writes an empty block)."""
        last_end, last_start = _last_index(prompt, end), _last_index(prompt, start)
        return None if last_end > last_start else cls(tuple(end))


def _last_index(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Where `sub` last occurs in `seq`, -1 if nowhere (or `sub` is empty)."""
    n = len(sub)
    if n == 0:
        return -1
    first = sub[0]
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == first and list(seq[i:i + n]) == list(sub):
            return i
    return -1


class Grammar:
    """Where one sequence is in its grammar: accept tokens, roll back, fill mask rows."""

    def __init__(self, compiled: Any, stop_token_ids: Iterable[int] = (), gate: ReasoningGate | None = None,
                 steer: LimitSteer | None = None) -> None:
        import xgrammar as xgr  # noqa: PLC0415 - loaded by the compiler already

        stops = sorted(stop_token_ids)
        # the request's own stop ids (EOS unless ignore_eos, plus stop_token_ids) end the grammar
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size  # the logits width the mask covers
        self.gate = gate  # None: the grammar applies (from the first token, or since the reasoning ended)
        self.steer = steer  # None: no steering at the token limit (not a JSON grammar)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (the mask should have prevented it)."""
        if self.gate is not None:
            self.gate = self.gate.after(token_id)
            return True
        steer = self.steer
        if steer is not None:
            if steer.plan and steer.plan[0] != token_id:
                return False
            steer.accepted(token_id)
            if steer.closing:  # JSON syntax past what the grammar allows: the matcher stays where it was
                return True
        return self.matcher.accept_token(int(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token, or a forced completion is written: nothing more may follow."""
        if self.gate is not None:
            return False
        return self.matcher.is_terminated() or (self.steer is not None and self.steer.done)

    @property
    def steered(self) -> bool:
        """The output was closed early to fit max_tokens: it ended for its length."""
        return self.steer is not None and self.steer.steered

    def valid_prefix(self, tokens: list[int], tokens_left: int | None = None) -> int:
        """How many of `tokens` (drafts) the grammar accepts in a row; the matcher is left unchanged.

        With a limit steer, drafts stop before the next point where it looks (`tokens_left`: what the request may
        still emit), so every row it would steer is a row 0, and speculation changes no output."""
        if self.steer is not None and self.gate is None:
            tokens = tokens[:self.steer.draft_room(tokens_left)]
        gate, n, advanced = self.gate, 0, 0
        for t in tokens:
            if gate is not None:
                gate = gate.after(t)
            elif self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            else:
                advanced += 1
            n += 1
        if advanced:
            self.matcher.rollback(advanced)
        return n

    def fill(self, bitmask: Any, row: int, drafts: list[int], tokens_left: int | None = None) -> None:
        """Rows row .. row + len(drafts): the allowed tokens now and after each draft (drafts are valid).

        Rows before the reasoning ends stay as allocated: every token allowed. `tokens_left`: how many tokens the
        request may still emit (None: no limit to steer by)."""
        if self.gate is None and self.steer is not None and tokens_left is not None:
            forced = self.steer.forced(self.matcher, tokens_left)
            if forced is not None:
                _fill_forced(bitmask, row, drafts, self.steer.plan)
                return
        self._fill_rows(bitmask, row, drafts)
        if self.gate is None and self.steer is not None and self.steer.blocked:  # near the limit: nothing new opens
            bitmask[row] &= self.steer.table.keep_mask(self.steer.blocked, bitmask.shape[1])

    def _fill_rows(self, bitmask: Any, row: int, drafts: list[int]) -> None:
        gate, advanced = self.gate, 0
        for j in range(len(drafts) + 1):
            if gate is None and self.matcher.is_terminated():
                break  # a draft was the stop token: the request ends there, later rows are never read
            if gate is None:
                self.matcher.fill_next_token_bitmask(bitmask, row + j)
            if j == len(drafts):
                break
            t = drafts[j]
            if gate is not None:
                gate = gate.after(t)
            elif self.matcher.accept_token(int(t)):
                advanced += 1
            else:  # cannot happen for drafts cut by valid_prefix
                log.error("grammar refused a validated draft token %d; its rows stay unconstrained", t)
                break
        if advanced:
            self.matcher.rollback(advanced)


def _fill_forced(bitmask: Any, row: int, drafts: list[int], plan: list[int]) -> None:
    """Row j allows only plan[j] while the drafts before it follow the plan (a draft off it is rejected anyway)."""
    for j in range(len(drafts) + 1):
        if j >= len(plan) or (j and drafts[j - 1] != plan[j - 1]):
            break
        t = plan[j]
        bitmask[row + j].zero_()
        bit = 1 << (t % 32)
        bitmask[row + j, t // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words: bit 31 is the sign


def fill_bitmask(items: list[tuple[Grammar | None, list[int], int | None, ReasoningBudget | None]],
                 vocab_size: int | None = None) -> np.ndarray:
    """[rows, ceil(V / 32)] int32, token t allowed iff bit t % 32 of word t // 32 is set; 1 + drafts rows each.

    Each item: a grammar (None: none), its drafts, how many tokens its request may still emit (None: not
    steered), and its reasoning budget (None: none), whose rows go over the grammar's (a grammar inside the
    reasoning is gated: its rows allow every token). `vocab_size`: the logits width when no item has a grammar
    to take it from."""
    import xgrammar as xgr  # noqa: PLC0415

    rows = sum(1 + len(d) for _, d, _, _ in items)
    width = next((g.vocab_size for g, _, _, _ in items if g is not None), vocab_size)
    bitmask = xgr.allocate_token_bitmask(rows, width)  # all allowed
    row = 0
    for grammar, drafts, tokens_left, budget in items:
        if grammar is not None:
            grammar.fill(bitmask, row, drafts, tokens_left)
        if budget is not None:
            budget.fill(bitmask, row, drafts)
        row += 1 + len(drafts)
    return bitmask.numpy()
