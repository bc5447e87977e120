"""Turns accepted tokens into client-visible deltas: incremental detokenization and stop strings.

Stop strings may span token boundaries; a delta never contains any part of a stop string, so text
that could still become the start of one is held back until it cannot. The scheduler's stop checker
calls `check_stop_string` once per accepted token (so a stop string can end a request in the middle
of a multi-token step); `process` then builds the step's delta from the text already decoded. A repeated
tool call (`params.repeat_stop`, engine/repeat_stop.py) stops a request the same way, and text that may still
become one is held back the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lmserve.engine.detokenizer import IncrementalDetokenizer
from lmserve.engine.repeat_stop import RepeatedSpan
from lmserve.request import CompletionDelta, Request
from lmserve.tokenizer import Tokenizer


@dataclass
class _State:
    detok: IncrementalDetokenizer
    text: str = ""  # all text decoded so far (before stop truncation)
    emitted: int = 0  # characters of `text` already sent
    tokens_seen: int = 0  # output tokens already turned into deltas
    tokens_decoded: int = 0  # output tokens already fed to the detokenizer
    holdback: int = 0  # characters that may be the start of a stop string
    stops: list[str] = field(default_factory=list)
    stop_at: int | None = None  # where the matched stop string (or repeated call) begins in `text`
    repeat: RepeatedSpan | None = None  # the request's completed tool calls, when it has params.repeat_stop
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    """Per-request detokenizer and stop-string state."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        stops = req.params.stop
        self._states[req.request_id] = _State(
            IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens, req.prompt_token_ids),
            holdback=max((len(s) for s in stops), default=1) - 1, stops=list(stops),
            repeat=RepeatedSpan(*req.params.repeat_stop) if req.params.repeat_stop else None)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def check_stop_string(self, req: Request, token: int) -> str | None:
        """Decode up to `token` (the newest output token) and return the stop string it completes, if any ("" for
        a tool call that repeats an earlier one)."""
        st = self._states[req.request_id]
        prev_len = len(st.text)
        self._decode(req, st)
        matched = self._find_stop(st, prev_len, req)
        if st.repeat is not None:
            at = st.repeat.check(st.text)
            if at is not None and (matched is None or at < matched[0]):
                matched = (at, "")
        if matched is None:
            return None
        st.stop_at = matched[0]
        return matched[1]

    def process(self, req: Request) -> CompletionDelta:
        """The delta for `req`'s tokens since the last one (its text stops before any stop string)."""
        st = self._states[req.request_id]
        new_ids = req.output_token_ids[st.tokens_seen:]
        new_lp = req.output_logprobs[st.tokens_seen:] if req.params.logprobs is not None else None
        st.tokens_seen = len(req.output_token_ids)
        self._decode(req, st)
        if req.status.finished and st.stop_at is None:
            st.text += st.detok.flush()
        if st.stop_at is not None:
            end = st.stop_at
        elif req.status.finished:
            end = len(st.text)
        else:
            held = st.repeat.held_from(st.text) if st.repeat is not None else len(st.text)
            end = max(st.emitted, min(len(st.text) - st.holdback, held))
        delta_text = st.text[st.emitted:end]
        st.emitted = end
        delta = CompletionDelta(
            request_id=req.parent_id or req.request_id, index=req.index, token_ids=list(new_ids), text=delta_text,
            logprobs=new_lp, num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids))
        if req.params.prompt_logprobs is not None and not st.sent_prompt_logprobs:
            delta.prompt_logprobs = [None, *req.prompt_logprobs]
            st.sent_prompt_logprobs = True
        return delta

    def _decode(self, req: Request, st: _State) -> None:
        """Feed the detokenizer the output tokens it has not seen.

        A special stop token that ended the request (EOS) is not text, even with skip_special_tokens off (as
        vLLM); with it on, decoding skips it anyway."""
        if st.tokens_decoded == len(req.output_token_ids):
            return
        t0 = time.perf_counter()
        ids = req.output_token_ids[st.tokens_decoded:]
        if req.status.finished and ids[-1] in req.stop_token_ids and self.tokenizer.is_special(ids[-1]):
            ids = ids[:-1]
        st.text += st.detok.add(ids)
        st.tokens_decoded = len(req.output_token_ids)
        req.detokenize_s += time.perf_counter() - t0

    def _find_stop(self, st: _State, prev_len: int, req: Request) -> tuple[int, str] | None:
        """Earliest stop string that the new text completes (only once min_tokens is reached)."""
        if not st.stops or len(req.output_token_ids) < req.params.min_tokens:
            return None
        begin = max(st.emitted, prev_len - st.holdback)
        best: tuple[int, str] | None = None
        for s in st.stops:
            i = st.text.find(s, begin)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best
