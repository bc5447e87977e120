"""OpenAI chat chunks from the output parsers' events (parsers/): `delta.reasoning_content`, `delta.content` and
`delta.tool_calls` entries."""

from __future__ import annotations

from typing import Any

from lmserve.parsers.events import ContentDelta, ReasoningDelta, StreamEvent, ToolArgumentsDelta, ToolCallStart


def chat_chunk_tool_calls(events: list[StreamEvent]) -> list[dict[str, Any]]:
    """`delta.tool_calls` entries: a start entry per call, then its argument fragments (adjacent ones joined).

    Entries may go in one chunk (clients merge them by index) or one chunk each, as vLLM sends them.
    """
    entries: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            entries.append({"index": event.index, "id": event.id, "type": "function",
                            "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, ToolArgumentsDelta):
            last = entries[-1] if entries else None
            if last is not None and last["index"] == event.index and "id" not in last:
                last["function"]["arguments"] += event.text
            else:
                entries.append({"index": event.index, "function": {"arguments": event.text}})
    return entries


def chat_chunk_delta(events: list[StreamEvent]) -> dict[str, Any]:
    """A chunk's `delta` for these events: "reasoning_content", "content", "tool_calls", each only when present."""
    delta: dict[str, Any] = {}
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    if reasoning:
        delta["reasoning_content"] = reasoning
    content = "".join(e.joined for e in events if isinstance(e, ContentDelta))
    if content:
        delta["content"] = content
    tool_calls = chat_chunk_tool_calls(events)
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta


def chat_chunk_deltas(events: list[StreamEvent]) -> list[dict[str, Any]]:
    """The non-empty deltas of these events in order: one per chunk, a new one where text follows a call's events
    (a delta reads as its content before its calls, so text after a call goes in the next chunk; the Responses API
    makes its message / function_call items from the chunks in order)."""
    groups: list[list[StreamEvent]] = [[]]
    for event in events:
        if isinstance(event, ContentDelta) and any(isinstance(e, (ToolCallStart, ToolArgumentsDelta))
                                                   for e in groups[-1]):
            groups.append([])
        groups[-1].append(event)
    return [delta for delta in map(chat_chunk_delta, groups) if delta]
