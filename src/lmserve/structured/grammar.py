"""One sequence's grammar state (an xgrammar matcher) and the batch's token bitmask.

Protocol (vLLM v1's): the scheduler fills each constrained row's allowed tokens into one bitmask
per step; with drafts it advances the matcher through them to fill one row per draft position and
rolls back; `Scheduler.update` advances the matcher by the tokens actually accepted. Drafts are cut
at the first token the grammar refuses before they are scheduled (that row could not be filled, and
the draft would be rejected anyway: its logit is -inf).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np

log = logging.getLogger(__name__)


class Grammar:
    """Where one sequence is in its grammar: accept tokens, roll back, fill mask rows."""

    def __init__(self, compiled: Any, stop_token_ids: Iterable[int] = ()) -> None:
        import xgrammar as xgr  # noqa: PLC0415 - loaded by the compiler already

        stops = sorted(stop_token_ids)
        # the request's own stop ids (EOS unless ignore_eos, plus stop_token_ids) end the grammar
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size  # the logits width the mask covers

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (the mask should have prevented it)."""
        return self.matcher.accept_token(int(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts) the grammar accepts in a row; the matcher is left unchanged."""
        n = 0
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill(self, bitmask: Any, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts): the allowed tokens now and after each draft (drafts are valid)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        for j, t in enumerate(drafts):
            if not self.matcher.accept_token(int(t)):  # cannot happen for drafts cut by valid_prefix
                log.error("grammar refused a validated draft token %d; its rows stay unconstrained", t)
                self.matcher.rollback(j)
                return
            self.matcher.fill_next_token_bitmask(bitmask, row + 1 + j)
        if drafts:
            self.matcher.rollback(len(drafts))


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
