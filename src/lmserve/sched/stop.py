"""The one stop checker: run once per accepted token, in order, so a request can end in the middle of a
multi-token step (speculative decoding) and everything after the stopping token is dropped.

Order per token, as vLLM does: a stop token id (once min_tokens is reached), the end of the request's
grammar (structured outputs: it accepted a stop token, e.g. EOS under ignore_eos), then a stop string that
the token's text completes (or a repeated tool call, `params.repeat_stop`: found the same way), then the length
limit. Stop strings need text, which the engine layer
owns (incremental detokenization), so it is passed in as a callback and the scheduler stays below it.
"""

from __future__ import annotations

from typing import Callable

from lmserve.request import Request, RequestStatus

# (request, its newest output token) -> the stop string that the token's text completes, "" for a repeated call
# (engine/repeat_stop.py; stop strings are never empty), or None
StopStringCheck = Callable[[Request, int], "str | None"]


class StopChecker:
    """Decides after each accepted token whether its request is finished, and records why."""

    def __init__(self, stop_string: StopStringCheck | None = None) -> None:
        self.stop_string = stop_string

    def check(self, req: Request, token: int) -> RequestStatus | None:
        """Call after `token` was appended to req.output_token_ids; sets req.stop_reason when it stops."""
        n_out = len(req.output_token_ids)
        if n_out >= req.params.min_tokens and token in req.stop_token_ids:
            req.stop_reason = token if token in req.params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.terminated:
            req.stop_reason = None  # a completion forced to fit max_tokens (structured/limit.py) ends "length"
            return RequestStatus.FINISHED_LENGTH if req.grammar.steered else RequestStatus.FINISHED_STOPPED
        if self.stop_string is not None and (req.params.stop or req.params.repeat_stop):
            matched = self.stop_string(req, token)
            if matched is not None:
                req.stop_reason = matched or None
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
