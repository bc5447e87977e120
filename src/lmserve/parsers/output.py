"""One request's output parsers, reasoning first, then tool calls in the answer: what every API route calls.

`OutputParser.parse(text)` gives the whole reply's parts; `OutputParser.streamer()` the same parts as events for
a streamed reply (ReasoningDelta, ContentDelta, ToolCallStart, ToolArgumentsDelta). Tool calls are read only in
the answer, never in the reasoning (as vLLM). The two forms agree on any split of the text (each stage does, and
the answer's pieces feed the tool stage in order), except for a call cut off before its end (tool_calls.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.parsers.events import ContentDelta, StreamEvent
from lmserve.parsers.reasoning import ReasoningParser, ReasoningStreamer
from lmserve.parsers.tool_calls import ToolCall, ToolCallStreamer, join_content, parse_tool_parts
from lmserve.parsers.tool_formats import ToolFormat


@dataclass
class Parsed:
    """A whole reply's parts: reasoning and content None when empty, calls in order; `parts` the answer's content
    segments (str) and calls in the order written (what block APIs answer; `content` is its segments joined)."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    parts: list[str | ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class OutputParser:
    """The reasoning parser (None: no reasoning) and the tool format (None: the request offers no tools)."""

    reasoning: ReasoningParser | None = None
    tools: ToolFormat | None = None
    schemas: dict[str, dict] = field(default_factory=dict)  # tool name -> its parameters schema

    def parse(self, text: str) -> Parsed:
        """The parts of a whole generated text."""
        split = self.reasoning.split(text) if self.reasoning is not None else None
        answer = split.content if split is not None else text
        reasoning = split.reasoning if split is not None else None
        if self.tools is None:
            return Parsed(reasoning, answer or None, [], [answer] if answer else [])
        parts = parse_tool_parts(answer or "", self.tools, self.schemas)
        return Parsed(reasoning, join_content(parts), [p for p in parts if isinstance(p, ToolCall)], parts)

    def streamer(self) -> "OutputStreamer":
        """A fresh incremental parser for one streamed reply."""
        return OutputStreamer(self)


class OutputStreamer:
    """Deltas of one reply in, events out, as `OutputParser.parse` splits the whole text."""

    def __init__(self, parser: OutputParser) -> None:
        self._reasoning = ReasoningStreamer(parser.reasoning) if parser.reasoning is not None else None
        self._tools = ToolCallStreamer(parser.tools, parser.schemas) if parser.tools is not None else None

    @property
    def num_calls(self) -> int:
        """Tool calls begun so far."""
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, delta: str) -> list[StreamEvent]:
        """Events for the next piece of generated text."""
        events = self._reasoning.feed(delta) if self._reasoning is not None else [ContentDelta(delta)]
        return self._answer(events, final=False)

    def finish(self) -> list[StreamEvent]:
        """Events for what was held back, once the text is complete."""
        events = self._reasoning.finish() if self._reasoning is not None else []
        return self._answer(events, final=True)

    def _answer(self, events: list[StreamEvent], final: bool) -> list[StreamEvent]:
        """Answer text through the tool stage (when there is one); reasoning passes as it is."""
        if self._tools is None:
            return [e for e in events if e.text]
        out: list[StreamEvent] = []
        for e in events:
            out += self._tools.feed(e.text) if isinstance(e, ContentDelta) else [e]
        return out + (self._tools.finish() if final else [])
