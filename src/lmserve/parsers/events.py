"""The deltas the streaming parsers emit; each API family turns them into its own chunks or events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass
class ContentDelta:
    """Answer text (OpenAI `delta.content`); `sep` is set on the first delta of a content segment after an
    earlier one (text after a tool call, tool_calls.py): one-string APIs put it before the text, block APIs open a
    new block instead."""

    text: str
    sep: str = ""

    @property
    def joined(self) -> str:
        """The text as one content string continues with it."""
        return self.sep + self.text


@dataclass
class ReasoningDelta:
    """Reasoning text (OpenAI `delta.reasoning_content`)."""

    text: str


@dataclass
class ToolCallStart:
    """A call begins; its name is complete."""

    index: int
    id: str
    name: str


@dataclass
class ToolArgumentsDelta:
    """A fragment of call `index`'s arguments (JSON text; the fragments of a call join to its arguments)."""

    index: int
    text: str


StreamEvent = Union[ContentDelta, ReasoningDelta, ToolCallStart, ToolArgumentsDelta]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (a tag that may still complete)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def drain(step: Callable[[list, bool], bool], final: bool) -> list[StreamEvent]:
    """The events of a streaming machine's `step(events, final)`, called until it makes no more progress."""
    events: list[StreamEvent] = []
    while step(events, final):
        pass
    return events
