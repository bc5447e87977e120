"""Structured output that stays valid at the token limit: near max_tokens, force the shortest valid completion.

A JSON answer cut by max_tokens does not parse. So for JSON grammars (json_schema, json_object, tool-call
structural tags) each request's `LimitSteer` watches the tokens it has left, L, against k, the token count of the
shortest completion from its matcher's state (close the open string, arrays and objects; the schema's required
keys with short values). When L <= k + MARGIN it stops sampling freely: each next row allows one token, the next
of that completion, so the output ends complete within the limit, and the request finishes with reason "length".

When even the schema's shortest completion cannot fit (max_tokens below the schema's minimum, or one token took
the answer deep into a structure), a JSON answer (json_schema, json_object) is closed by JSON syntax alone: as
much of the schema's completion as fits, then the open strings, arrays and objects closed (`null` where a value
is owed). That output parses but may miss required keys; the grammar is left for those last tokens.

One free token can lengthen the shortest completion a lot (a "," that starts another array item with required
keys), so within JUMP_ZONE tokens of the limit the tokens holding an OPENER are masked out of the row whenever
what that opener starts could no longer be closed in time.

Cost: the common case is one comparison per step. k is computed (`shortest_completion`: a greedy search over
forked matchers, ~1-5 ms) at a request's first step, then at points that halve the distance to the limit
(log2(max_tokens) times for a request that ends on its own), and at every step only in its last JUMP_ZONE
tokens; speculative drafts stop before each of those looks (`draft_room`), so speculation changes no output.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from lmserve.structured.json_scan import JsonScan

MARGIN = 2  # force when L <= k + MARGIN: one free token may lengthen the completion by a little (a "," or a key)
SYNTAX_MARGIN = 5  # closing by syntax alone: one token may open a key whose name takes a few more
JUMP_ZONE = 24  # look at every step once L <= k + this; farther out, halve the distance between looks
# characters that open more JSON (another item or key, a nested value): within JUMP_ZONE, tokens holding one are
# masked out when what it would open could no longer be closed in time
OPENERS = (",", "{", "[")
_LEADS = ("", '"', "}", "]", '"}', '"]', "}]", "]}")  # what one token may close before an opener
MAX_COMPLETION_CHARS = 2048  # a schema whose shortest completion is longer is not steered
# characters the search tries, best first among equals: closers, the shortest values, then anything else
# (whitespace last, and only when nothing else is accepted: it never closes anything)
_CANDIDATES = ('"', "}", "]", "0", ",", ":", "n", "t", "f", "{", "[", "1", "-", ".", "e",
               *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ23456789_", " ", "\n")


class TokenTable:
    """Text -> tokens by greedy longest match over the vocabulary's decoded bytes (built once per tokenizer)."""

    def __init__(self, decoded_vocab: Sequence[bytes], excluded: Sequence[int] = ()) -> None:
        skip = set(excluded)
        self.ids: dict[bytes, int] = {}
        for i, b in enumerate(decoded_vocab):
            # special tokens (<|im_end|>) decode to their markup: never a piece of JSON text
            if i not in skip and b and not (b.startswith(b"<|") and b.endswith(b"|>")):
                self.ids.setdefault(bytes(b), i)
        self.max_len = min(32, max((len(b) for b in self.ids), default=1))
        self._keep: dict[tuple[str, int], Any] = {}

    def encode(self, text: str) -> list[int] | None:
        """Greedy longest-match token ids of `text`; None if some byte has no token."""
        data, out, i = text.encode(), [], 0
        while i < len(data):
            for n in range(min(self.max_len, len(data) - i), 0, -1):
                t = self.ids.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                return None
        return out

    def keep_mask(self, chars: str, words: int) -> Any:
        """[words] int32, a bitmask row with the bits of tokens holding any of `chars` cleared (cached per chars)."""
        import numpy as np  # noqa: PLC0415
        import torch  # noqa: PLC0415

        key = (chars, words)
        if key not in self._keep:
            keep = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
            marks = [c.encode() for c in chars]
            for b, t in self.ids.items():
                if any(m in b for m in marks) and t < words * 32:
                    keep[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            self._keep[key] = torch.from_numpy(keep.view(np.int32))
        return self._keep[key]

    def text(self, ids: Sequence[int]) -> bytes:
        """The bytes of token ids (reverse of the table; ids outside it, e.g. special tokens, give b"")."""
        rev = self._rev()
        return b"".join(rev.get(t, b"") for t in ids)

    def _rev(self) -> dict[int, bytes]:
        if not hasattr(self, "_reverse"):
            self._reverse = {t: b for b, t in self.ids.items()}
        return self._reverse


def shortest_completion(matcher: Any, scan: JsonScan) -> str | None:
    """A short text that takes `matcher` (left unchanged) to a completed state; None if the search gives up.

    Greedy: take the grammar's forced text (jump-forward), else the accepted character that leaves the least JSON
    to close (ties: `_CANDIDATES` order), until the grammar may end. Not always the very shortest (an enum's first
    accepted letter, not its shortest member), but complete, in one pass, with no backtracking."""
    m, scan, out = matcher.fork(), scan.copy(), []
    size = 0
    while not m.is_completed():
        jump = m.find_jump_forward_string()
        if jump:
            m.accept_string(jump)
            scan.feed(jump)
            out.append(jump)
            size += len(jump)
            continue
        best = _best_char(m, scan)
        if best is None or size >= MAX_COMPLETION_CHARS:
            return None
        m.accept_string(best)
        scan.feed(best)
        out.append(best)
        size += 1
    return "".join(out)


def _best_char(m: Any, scan: JsonScan) -> str | None:
    """The accepted character that leaves the least open (`JsonScan.owed`); among equals one that ends what is being
    written (a number's ",": the grammar's next key follows), then `_CANDIDATES` order."""
    now, best, best_key = scan.owed(), None, None
    for c in _CANDIDATES:
        if c in " \n" and best is not None or not m.fork().accept_string(c):
            continue
        after = scan.copy().feed(c)
        key = (after.owed(), after.mode == scan.mode)
        if key[0] < now:
            return c  # closes something: no candidate can do better than by one
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best


# -- one request's steering -------------------------------------------------------------------------------------

class LimitSteer:
    """One request's watch on its token limit: None while it samples freely, else the one token to force."""

    def __init__(self, table: TokenTable, json_text: bool) -> None:
        self.table = table
        self.json_text = json_text  # the whole output is one JSON value: it may be closed by syntax alone
        self.next_look: int | None = None  # look again when L <= this; None: at the first step
        self.plan: list[int] = []  # the tokens being forced, next first
        self.steered = False  # a completion was forced: the request ends "length"
        self.closing = False  # the plan is JSON syntax beyond the grammar: the matcher is not fed
        self.syntax_only = False  # the schema's shortest completion did not fit: watch the JSON syntax only
        self._ids: list[int] = []  # accepted tokens not yet scanned (scanned at the next look, off the common path)
        self._seen = b""  # the text scanned so far
        self._scan = JsonScan()
        self.blocked = ""  # this row: characters whose tokens are masked out (OPENERS that would overrun)

    def accepted(self, token: int) -> None:
        """One token the request accepted (the plan's next one while steering)."""
        if self.plan:
            self.plan.pop(0)
        elif not self.steered:
            self._ids.append(token)

    def draft_room(self, tokens_left: int | None) -> int:
        """How many drafts may run before the next row this steer looks at (None: unknown, none)."""
        if self.steered or self.next_look is None or tokens_left is None:
            return 0
        return max(0, tokens_left - 1 - self.next_look)

    @property
    def done(self) -> bool:
        """The forced completion has been emitted: the request ends here."""
        return self.steered and not self.plan

    def forced(self, matcher: Any, tokens_left: int) -> int | None:
        """The token the next row must be (None: the grammar's own row, less tokens holding `blocked` characters),
        for a request with `tokens_left` to go."""
        self.blocked = ""
        if self.plan:
            return self.plan[0]
        if self.steered or (self.next_look is not None and tokens_left > self.next_look):
            return None
        return self._look(matcher, tokens_left)

    def _look(self, matcher: Any, tokens_left: int) -> int | None:
        new = self.table.text(self._ids)
        self._seen += new
        self._scan.feed(new.decode("utf-8", "replace"))
        self._ids = []
        if self.syntax_only:
            return self._look_syntax(matcher, tokens_left)
        text = shortest_completion(matcher, self._scan)
        ids = self.table.encode(text) if text else [] if text == "" else None  # "": the grammar may end here
        k = len(ids) if ids is not None else None
        if k is not None and (tokens_left > k + MARGIN or k == 0):
            gap = tokens_left - k
            self.next_look = tokens_left - 1 if gap <= JUMP_ZONE else tokens_left - gap // 2
            if gap <= JUMP_ZONE:
                self.blocked = self._too_long_openers(matcher, tokens_left)
            return None
        if k is not None and k <= tokens_left and _accepts(matcher, ids):
            return self._force(ids, closing=False)
        if self.json_text:  # the schema's completion does not fit: from here on, close by JSON syntax
            self.syntax_only = True
            return self._look_syntax(matcher, tokens_left)
        self.next_look = -1  # nothing fits: leave the request to its limit
        return None

    def _too_long_openers(self, matcher: Any, tokens_left: int) -> str:
        """The OPENERS after which the grammar's shortest completion would not fit in the tokens left after this
        one (after what the same token may close first)."""
        blocked = ""
        for c in OPENERS:
            for lead in _LEADS:  # one token may close a string and an object, then open the next ('"}, {')
                probe = matcher.fork()
                if not probe.accept_string(lead + c):
                    continue
                rest = shortest_completion(probe, self._scan.copy().feed(lead + c))
                ids = self.table.encode(lead + c + rest) if rest is not None else None
                if ids is None or len(ids) + MARGIN > tokens_left:
                    blocked += c
                    break
        return blocked

    def _look_syntax(self, matcher: Any, tokens_left: int) -> int | None:
        """Sample under the grammar until the shortest syntactic closing needs all but SYNTAX_MARGIN tokens."""
        tails = self._syntax_tails(matcher.find_jump_forward_string())
        self.next_look = tokens_left - 1
        if not tails or tokens_left > min(len(ids) for ids in tails) + SYNTAX_MARGIN:
            return None
        seen = self._seen.decode("utf-8", "replace")
        fits = [ids for ids in tails if len(ids) <= tokens_left and _parses(seen + self.table.text(ids).decode())]
        return self._force(fits[0], closing=True) if fits else None

    def _force(self, plan: list[int], closing: bool) -> int:
        self.plan, self.steered, self.closing = plan, True, closing
        return plan[0]

    def _syntax_tails(self, completion: str) -> list[list[int]]:
        """Token ids of each prefix of the grammar's forced text closed by JSON syntax, longest first; closings
        that make up a key only when nothing else closes."""
        scans = [self._scan.copy()]
        for c in completion:
            scans.append(scans[-1].copy().feed(c))
        clean, keyed = [], []
        for i in range(len(completion), -1, -1):
            if not (scans[i].started or scans[i].stack):
                continue  # no value begun: nothing to close
            ids = self.table.encode(completion[:i] + scans[i].closing())
            if ids:
                (keyed if scans[i].half_key else clean).append(ids)
        return clean or keyed


def _accepts(matcher: Any, ids: list[int]) -> bool:
    probe = matcher.fork()
    return all(probe.accept_token(t) for t in ids)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


STEERED_KINDS = {"json": True, "json_object": True, "structural_tag": False}  # kind -> the output is one JSON value


def limit_steer(compiler: Any, params: Any) -> LimitSteer | None:
    """A fresh steer for a request of `params` (SamplingParams) under `compiler`'s vocabulary; None when its grammar
    is not JSON (regex, EBNF, choice: no shortest completion worth forcing) or it has none."""
    spec = params.structured_outputs
    if spec is None or spec.kind not in STEERED_KINDS or compiler is None:
        return None
    return LimitSteer(compiler.token_table(), STEERED_KINDS[spec.kind])
