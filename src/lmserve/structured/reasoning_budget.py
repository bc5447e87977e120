"""A reasoning budget: at most N reasoning tokens, then the end tag is forced and the answer follows.

As llama.cpp's `--reasoning-budget` and SGLang's thinking budget do it, in the engine: the sequence counts its
reasoning tokens (from the first generated token when the prompt left a "<think>" open, as Qwen3's and R1's
templates do; otherwise from the moment the output writes the start tag), and when only the end tag's tokens
still fit in the budget, each next row of the step's bitmask allows one token, the next of the end tag
("</think>" as the tokenizer encodes it) and then ANSWER_SEPARATOR, so the reasoning closes exactly as the
template writes a closed reasoning ("</think>\n\n" in Qwen3's and R1's) and the model goes on with its answer.
From the reasoning's start to the answer's first token the request's stop tokens are masked out: a model that
would stop inside its reasoning (one not trained to reason, like the tests' SmolLM2) or right after it still
answers, so a budgeted reasoning is always followed by an answer. Those bans ride on the sampler's ban list (as min_tokens'
does: `ScheduledRequest.stop_ban_rows`); a bitmask row is filled only for the few steps that force a token. The budget counts every reasoning token, the end tag's included (usage's
`reasoning_tokens` counts the same span), so a closed reasoning is at most `budget` tokens long; a budget
smaller than the end tag still writes the whole tag (the reasoning must close for an answer to follow).

The forced tokens reach a structured-output grammar's `ReasoningGate` like sampled ones, so a grammar (a
response_format, a tool call's structural tag) starts right after the forced end tag, never inside the reasoning.
Speculative drafts stop where forcing begins (`draft_room`), so speculation changes no output.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Sequence

# what Qwen3's and DeepSeek R1's templates write between "</think>" and the answer: forced after a forced end tag
ANSWER_SEPARATOR = "\n\n"


class ReasoningBudget:
    """One sequence's reasoning budget: where its reasoning stands, and the end-tag tokens still to force."""

    def __init__(self, start: Sequence[int], end: Sequence[int], budget: int, open_in_prompt: bool,
                 vocab_size: int, stop_token_ids: Iterable[int] = (), separator: Sequence[int] = ()) -> None:
        self.start, self.end, self.budget = tuple(start), tuple(end), budget
        self.separator = tuple(separator)  # forced after a forced end tag (ANSWER_SEPARATOR's tokens)
        self.vocab_size = vocab_size  # the logits width a row covers
        self.stop_token_ids = sorted(stop_token_ids)  # masked out until the answer's first token
        self.used: int | None = 0 if open_in_prompt else None  # reasoning tokens so far; None: not begun
        self.done = False  # the end tag was written (sampled or forced)
        self.answered = False  # the answer's first token was written: nothing more to watch
        self.plan: list[int] = []  # end-tag (then separator) tokens still to force
        self._recent: tuple[int, ...] = ()  # the last tokens, enough to see a tag spanning steps
        self._plan_if_spent()

    @classmethod
    def for_prompt(cls, prompt: Sequence[int], start: Sequence[int], end: Sequence[int], budget: int,
                   vocab_size: int, stop_token_ids: Iterable[int] = (),
                   separator: Sequence[int] = ()) -> "ReasoningBudget":
        """The budget of a request: counting from the first token when the prompt's last tag is an open start."""
        return cls(start, end, budget, _last_index(prompt, start) > _last_index(prompt, end), vocab_size,
                   stop_token_ids, separator)

    @property
    def active(self) -> bool:
        """Whether the next rows may be constrained (False once the answer has begun)."""
        return not self.answered

    @property
    def forced(self) -> int | None:
        """The one token the next row allows (None: sampling is free, stop tokens aside while `bans_stop`)."""
        return self.plan[0] if self.plan else None

    @property
    def bans_stop(self) -> bool:
        """Whether the next row masks the stop tokens: inside the reasoning, and for the answer's first token."""
        return self.used is not None and not self.answered

    def draft_room(self) -> int | None:
        """How many drafts may run before forcing begins (None: no limit)."""
        if self.done:
            return 0 if self.plan else None
        if self.used is None:
            return None  # before the start tag a draft may write it: then it is counted like a sampled token
        return 0 if self.plan else max(0, self.budget - len(self.end) - self.used)

    def accept(self, token: int) -> None:
        """Advance by one generated token."""
        if self.done:
            if self.plan:  # the separator after a forced end tag
                self.plan = self.plan[1:] if token == self.plan[0] else []
            else:
                self.answered = True
            return
        self._recent = (*self._recent, int(token))[-max(len(self.start), len(self.end)):]
        if self.used is None:
            if _ends_with(self._recent, self.start):
                self.used = len(self.start)  # the start tag's tokens are reasoning tokens too
                self._plan_if_spent()
            return
        self.used += 1
        if self.plan:
            # a forced row allows one token; another here means the caller ran without the mask: re-plan
            self.plan = self.plan[1:] if token == self.plan[0] else []
        if _ends_with(self._recent, self.end):
            self.done = True  # what is left of a plan is the separator: a model's own end tag leaves none
            return
        self._plan_if_spent()

    def rows(self, drafts: list[int]) -> tuple[bool, list[int]]:
        """(whether any of the rows 0 .. len(drafts) is forced, which of them mask the stop tokens), the drafts
        followed on a copy. Without a forced row the stop bans go to the sampler's ban list (cheap, as min_tokens'),
        not to a bitmask row."""
        state = self._copy()
        forced, bans = False, []
        for j in range(len(drafts) + 1):
            forced = forced or state.forced is not None
            if state.bans_stop:
                bans.append(j)
            if j == len(drafts) or not state.active:
                break
            state.accept(drafts[j])
        return forced, bans

    def _copy(self) -> "ReasoningBudget":
        state = copy.copy(self)
        state.plan = list(self.plan)
        return state

    def fill(self, bitmask: Any, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts) (on top of what a grammar filled): the forced token alone, or the stop
        tokens cleared; the drafts are followed on a copy, so each row is the state after the drafts before it."""
        state = self._copy()
        for j in range(len(drafts) + 1):
            forced = state.forced
            if forced is not None:
                bitmask[row + j].zero_()
                _set_bit(bitmask, row + j, forced)
            elif state.bans_stop:
                for t in state.stop_token_ids:
                    _clear_bit(bitmask, row + j, t)
            if j == len(drafts) or not state.active:
                break
            state.accept(drafts[j])

    def _plan_if_spent(self) -> None:
        """Start forcing the end tag once only its tokens still fit in the budget."""
        if self.used is not None and not self.done and not self.plan and self.used + len(self.end) >= self.budget:
            self.plan = [*self.end, *self.separator]


def _word(bit: int) -> int:
    """An int32 word's value with only `bit` set (bit 31 is the sign)."""
    v = 1 << bit
    return v - (1 << 32) if v >= 1 << 31 else v


def _set_bit(bitmask: Any, row: int, t: int) -> None:
    bitmask[row, t // 32] |= _word(t % 32)


def _clear_bit(bitmask: Any, row: int, t: int) -> None:
    if t // 32 < bitmask.shape[1]:
        bitmask[row, t // 32] &= ~_word(t % 32)


def _ends_with(seq: tuple[int, ...], tag: tuple[int, ...]) -> bool:
    return bool(tag) and seq[-len(tag):] == tag


def _last_index(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Where `sub` last occurs in `seq`, -1 if nowhere (or `sub` is empty)."""
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and tuple(seq[i:i + n]) == tuple(sub):
            return i
    return -1
