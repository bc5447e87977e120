"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>…</think>` text split from its answer.

Two families, as vLLM names and splits them:
- deepseek_r1: the opening tag is usually in the prompt (R1 distills' templates end with "<think>\\n"), so all
  text before the first "</think>" is reasoning (a "<think>" the model writes itself, at the very start, is
  dropped); without "</think>" (cut off, or still thinking) all of it is reasoning.
- qwen3: reasoning only where the model writes "<think>": text before it is content, text between it and the
  first "</think>" reasoning (all the rest when "</think>" never comes), text after content.
- gpt_oss: as qwen3, with harmony's analysis channel as the tags (`<|channel|>analysis<|message|>` ... `<|end|>`).
Tags are matched as text (a tokenizer with `<think>` as one token decodes it to the same text). Later tags are
plain text of the part they fall in. Nothing is stripped: "\\n\\nThe answer" after "</think>" stays as is, as
vLLM returns it. With `enable_thinking: false` (or `thinking: false`) in chat_template_kwargs there is no
reasoning (`parser_for` gives None): the template wrote an empty think block into the prompt, all output is the
answer, and a grammar applies from the first token.

`ReasoningStreamer` turns deltas into ReasoningDelta / ContentDelta events, holding back only a tail that may
still become a tag; `split()` is that same machine run over the whole text, so the two agree on every split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lmserve.parsers.events import ContentDelta, ReasoningDelta, StreamEvent, drain, partial_suffix

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """One family's rule; `starts_in_prompt`: reasoning from the first token (deepseek_r1) or from "<think>"."""

    name: str
    starts_in_prompt: bool
    start: str = THINK_START
    end: str = THINK_END
    keeps_special_tokens: bool = False  # its tags are special tokens (gpt-oss's harmony): keep them in the text

    def split(self, text: str) -> "Split":
        """(reasoning, content) of a whole generated text; each None when empty."""
        streamer = ReasoningStreamer(self)
        events = streamer.feed(text) + streamer.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return Split(reasoning or None, content or None)

    def num_tokens(self, ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
        """How many of a reply's token `ids` are reasoning: those up to the one that completes the end tag (the
        tags count, as hidden tokens do in OpenAI's `reasoning_tokens`); all when the end never came; none when
        the reasoning never began (qwen3 without "<think>")."""
        text = decode(ids)
        if not self.starts_in_prompt and self.start not in text:
            return 0
        if self.end not in text:
            return len(ids)
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds the end tag (holding it is monotone)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.end in decode(ids[:mid]) else (mid + 1, hi)
        return lo


@dataclass(frozen=True)
class Split:
    """A generated text's reasoning and answer."""

    reasoning: str | None
    content: str | None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_prompt=True),
    "qwen3": ReasoningParser("qwen3", starts_in_prompt=False),
    # gpt-oss (harmony): its first analysis-channel message is the reasoning; the rest (commentary calls, the
    # final channel) is the answer, read by the harmony tool format
    "gpt_oss": ReasoningParser("gpt_oss", starts_in_prompt=False, start="<|channel|>analysis<|message|>",
                               end="<|end|>", keeps_special_tokens=True),
}


def thinking_disabled(template_kwargs: dict[str, Any] | None) -> bool:
    """Whether the request turned thinking off (Qwen3's `enable_thinking`, DeepSeek V3.1's `thinking`)."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def parser_for(name: str | None, template_kwargs: dict[str, Any] | None = None) -> ReasoningParser | None:
    """The server's reasoning parser for one request: None without one, or when the request turned thinking off."""
    if name is None or thinking_disabled(template_kwargs):
        return None
    return REASONING_PARSERS[name]


# Reasoning effort -> reasoning budget in tokens (the end tag's included; structured/reasoning_budget.py enforces
# it): OpenAI chat's `reasoning_effort`, Responses' `reasoning.effort`, Ollama's `think` level. "minimal" (and
# OpenAI's "none") closes the reasoning at once. These are this server's choice: OpenAI publishes no numbers.
EFFORT_BUDGETS: dict[str, int] = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384}


def effort_budget(effort: str | None, max_tokens: int | None) -> int | None:
    """The reasoning budget of an effort level (None: no level, no budget), capped at half of max_tokens so that
    an answer always has room after the reasoning (an explicit Anthropic budget_tokens is taken as given)."""
    if effort is None:
        return None
    budget = EFFORT_BUDGETS[effort]
    return budget if max_tokens is None else min(budget, max_tokens // 2)


# The machine's states: before "<think>" (qwen3), at the start where "<think>" may still be written
# (deepseek_r1), inside the reasoning, after it.
_BEFORE, _OPENING, _REASONING, _AFTER = "before", "opening", "reasoning", "after"


class ReasoningStreamer:
    """Deltas of generated text in, ReasoningDelta / ContentDelta events out, as `ReasoningParser.split` splits."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._state = _OPENING if parser.starts_in_prompt else _BEFORE
        self._pending = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning (or may still be)."""
        return self._state in (_OPENING, _REASONING)

    def feed(self, delta: str) -> list[StreamEvent]:
        """Events for the next piece of generated text."""
        self._pending += delta
        return drain(self._step, False)

    def finish(self) -> list[StreamEvent]:
        """Events for what was held back, once the text is complete."""
        return drain(self._step, True)

    def _step(self, events: list[StreamEvent], final: bool) -> bool:
        """Emit what is decided; True if the state changed (then step again)."""
        p, text = self.parser, self._pending
        if self._state == _OPENING:
            if text.startswith(p.start):
                self._pending, self._state = text[len(p.start):], _REASONING
                return True
            if p.start.startswith(text) and not final:
                return False  # may still become "<think>"
            self._state = _REASONING
            return True
        if self._state == _AFTER:
            self._emit(events, ContentDelta, len(text))
            return False
        tag, kind, next_state = ((p.start, ContentDelta, _REASONING) if self._state == _BEFORE
                                 else (p.end, ReasoningDelta, _AFTER))
        at = text.find(tag)
        if at < 0:
            self._emit(events, kind, len(text) if final else len(text) - partial_suffix(text, tag))
            return False
        self._emit(events, kind, at)
        self._pending, self._state = self._pending[len(tag):], next_state
        return True

    def _emit(self, events: list[StreamEvent], kind: type, n: int) -> None:
        """The first n pending characters as one event of `kind` (joined to the previous one of that kind)."""
        text, self._pending = self._pending[:n], self._pending[n:]
        if not text:
            return
        if events and type(events[-1]) is kind:
            events[-1].text += text
        else:
            events.append(kind(text))
