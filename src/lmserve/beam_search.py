"""Beam search as a driver above the engine (vLLM's design), ranked exactly as transformers' `generate(num_beams=...)`.

`BeamSearch` is the search state of one prompt and does no I/O: `pending()` names the sequences to extend, the
caller runs each as a one-token greedy request asking for its top logprobs (`step_params`), and `advance()` takes
those logprobs. The offline `LLM.beam_search` and the server's `use_beam_search` drive it the same way. Beams share
their prompt and common prefix in the paged cache through the prefix cache: each step's request of a beam hits the
full blocks its ancestors wrote and computes only the unfinished last block (copy-on-write at block granularity,
nothing in the scheduler has to know about beams).

The ranking follows transformers (generation/utils.py `_beam_search`, 5.x): candidates are (beam, token) pairs by
cumulative logprob; a candidate among the top `beam_width` that ends with EOS (or reaches max_tokens) joins the
finished pool scored cum_logprob / generated_len ** length_penalty, the pool keeping the best `beam_width`; the
best `beam_width` others run on; `early_stopping` ends the search as transformers' stopping heuristic does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from lmserve.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM names it: `tokens` include the prompt's; `text` is filled when it is returned."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length" (max_tokens)
    stop_reason: int | None = None  # the EOS token id that ended it
    score: float = 0.0  # cum_logprob / len(output) ** length_penalty: what the beams are ranked by


@dataclass
class BeamSearchOutput:
    """The finished beams of one prompt, best first (`beam_width` of them)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(frozen=True)
class _Candidate:
    score: float  # cumulative logprob
    beam: int
    token: int


class BeamSearch:
    """The search over one prompt: live beams (tokens generated, cumulative logprob) and the finished pool."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_tokens: int) -> None:
        self.prompt, self.params, self.max_tokens = list(prompt_ids), params, max_tokens
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.live: list[tuple[list[int], float]] = [([], 0.0)]  # the first step extends the prompt alone
        self.finished: list[BeamSearchSequence] = []  # best first, at most beam_width
        self.num_steps = 0  # tokens every live beam has generated
        self.improvable = True  # transformers' early-stop heuristic, once false stays false
        self.done = False

    @property
    def num_logprobs(self) -> int:
        """Top logprobs each beam's request asks for: a candidate that can rank among the best beam_width, or be
        one of the beam_width that run on, is among its beam's top beam_width + (number of EOS ids)."""
        return min(self.params.beam_width + len(self.eos), MAX_LOGPROBS)

    def pending(self) -> list[list[int]]:
        """The sequences (prompt + beam) whose next-token logprobs the next advance() needs; [] once done."""
        return [] if self.done else [self.prompt + tokens for tokens, _ in self.live]

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        """Extend every live beam by one token: `tops[i]` is live beam i's (token id, logprob), best first."""
        width = self.params.beam_width
        cands = sorted((_Candidate(self.live[b][1] + logprob, b, tok) for b, top in enumerate(tops) for tok, logprob
                        in top), key=lambda c: (-c.score, c.beam, c.token))
        last = self.num_steps + 1 >= self.max_tokens
        ends = [last or c.token in self.eos for c in cands]
        self._finish([c for c, end in zip(cands[:width], ends) if end])
        running = [c for c, end in zip(cands, ends) if not end][:width]
        self.live = [(self.live[c.beam][0] + [c.token], c.score) for c in running]
        self.num_steps += 1
        self._check_done(last or not running)

    def _finish(self, cands: list[_Candidate]) -> None:
        """Put the candidates that just ended (among the best beam_width) into the pool, as transformers gates them."""
        width, p = self.params.beam_width, self.params
        if not cands or not self.improvable or (len(self.finished) == width and p.early_stopping is True):
            return
        length = self.num_steps + 1
        for c in cands:
            tokens = self.live[c.beam][0] + [c.token]
            eos = c.token in self.eos
            self.finished.append(BeamSearchSequence(self.prompt + tokens, c.score, None, "stop" if eos else "length",
                                                    c.token if eos else None, c.score / length ** p.length_penalty))
        self.finished.sort(key=lambda s: -s.score)  # stable: an earlier finisher wins a tie
        del self.finished[width:]

    def _check_done(self, no_continuation: bool) -> None:
        """transformers' `_check_early_stop_heuristic` and `_beam_search_has_unfinished_sequences`."""
        p, full = self.params, len(self.finished) == self.params.beam_width
        if full and self.live:
            length = self.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else self.num_steps
            best_running = self.live[0][1] / length ** p.length_penalty
            self.improvable = self.improvable and best_running > self.finished[-1].score
        self.done = no_continuation or not self.improvable or (full and p.early_stopping is True)

    def outputs(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The finished beams, best first, their `text` decoded by `decode(token ids)` (vLLM: the whole sequence)."""
        for seq in self.finished:
            seq.text = decode(seq.tokens)
        return BeamSearchOutput(self.finished)


def next_batch(searches: list[BeamSearch]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Every live beam of every unfinished search as a one-token request: its sequence and its params (greedy,
    its search's top logprobs, EOS not special). Empty once every search is done."""
    seqs, plist = [], []
    for s in searches:
        pending = s.pending()
        seqs += pending
        plist += [SamplingParams(max_tokens=1, temperature=0.0, logprobs=s.num_logprobs, ignore_eos=True,
                                 skip_special_tokens=False)] * len(pending)
    return seqs, plist


def advance_all(searches: list[BeamSearch], tops: list[list[tuple[int, float]]]) -> None:
    """Hand each unfinished search its beams' top logprobs, `tops` in next_batch's order."""
    it = iter(tops)
    for s in searches:
        if not s.done:
            s.advance([next(it) for _ in s.live])
