"""Logprobs in the shapes the APIs return: OpenAI's completions and chat formats, vLLM's prompt_logprobs.

`piece` turns a token id into its text (Tokenizer.id_to_piece).
"""

from __future__ import annotations

from typing import Callable, Sequence

from lmserve.request import TokenLogprobs

Piece = Callable[[int], str]
MIN_LOGPROB = -9999.0  # what JSON gets for -inf (vLLM's clamp): a token-id prompt may hold impossible tokens


def completion_logprobs(piece: Piece, token_ids: list[int], lps: Sequence[TokenLogprobs | None],
                        start: int = 0) -> dict:
    """The legacy completions format: parallel lists plus a dict of alternatives per position.

    A position with no logprobs (a prompt's first token) has null for both. text_offset counts
    characters from the start of the choice's text (`start` is where these tokens begin).
    """
    tokens = [piece(t) for t in token_ids]
    offsets, pos = [], start
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [None if t is None else _finite(t.logprob) for t in lps],
            "top_logprobs": [None if t is None else {piece(i): _finite(lp) for i, lp in t.top} for t in lps],
            "text_offset": offsets}


def vllm_prompt_logprobs(piece: Piece, lps: list[TokenLogprobs | None] | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token {token_id: {logprob, rank, decoded_token}}, the token first.

    Each entry holds the prompt's token (ranked in the whole vocabulary) and the top-k (ranks 1..k).
    """
    if lps is None:
        return None

    def ranked(t: TokenLogprobs) -> dict:
        entry = {t.token_id: {"logprob": _finite(t.logprob), "rank": t.rank, "decoded_token": piece(t.token_id)}}
        for rank, (i, lp) in enumerate(t.top, 1):
            entry.setdefault(i, {"logprob": _finite(lp), "rank": rank, "decoded_token": piece(i)})
        return entry

    return [None if t is None else ranked(t) for t in lps]


def chat_logprobs(piece: Piece, lps: list[TokenLogprobs]) -> list[dict]:
    """The chat format: per generated token its text, logprob, UTF-8 bytes and the top alternatives.

    Logprobs are clamped as in the completions format: a grammar masks alternatives to -inf, which JSON
    cannot carry (json.dumps writes -Infinity, and browsers' JSON.parse refuses the whole chunk).
    """

    def entry(token_id: int, logprob: float) -> dict:
        text = piece(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in lps]


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
