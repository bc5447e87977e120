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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

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

    def __init__(self, compiled: Any, stop_token_ids: Iterable[int] = (), gate: ReasoningGate | None = None) -> None:
        import xgrammar as xgr  # noqa: PLC0415 - loaded by the compiler already

        stops = sorted(stop_token_ids)
        # the request's own stop ids (EOS unless ignore_eos, plus stop_token_ids) end the grammar
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size  # the logits width the mask covers
        self.gate = gate  # None: the grammar applies (from the first token, or since the reasoning ended)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (the mask should have prevented it)."""
        if self.gate is not None:
            self.gate = self.gate.after(token_id)
            return True
        return self.matcher.accept_token(int(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.gate is None and self.matcher.is_terminated()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts) the grammar accepts in a row; the matcher is left unchanged."""
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

    def fill(self, bitmask: Any, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts): the allowed tokens now and after each draft (drafts are valid).

        Rows before the reasoning ends stay as allocated: every token allowed."""
        gate, advanced = self.gate, 0
        for j in range(len(drafts) + 1):
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


def fill_bitmask(items: list[tuple[Grammar, list[int]]]) -> np.ndarray:
    """[rows, ceil(V / 32)] int32, token t allowed iff bit t % 32 of word t // 32 is set; 1 + drafts rows each."""
    import xgrammar as xgr  # noqa: PLC0415

    rows = sum(1 + len(d) for _, d in items)
    bitmask = xgr.allocate_token_bitmask(rows, items[0][0].vocab_size)  # all allowed
    row = 0
    for grammar, drafts in items:
        grammar.fill(bitmask, row, drafts)
        row += 1 + len(drafts)
    return bitmask.numpy()
