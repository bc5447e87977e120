"""The /v1/responses answer: output items built from a chat answer, the Response object, and the stream's events.

`OutputItems` is the one builder of a response's `output`, fed the same way by a whole chat answer and by
a chat stream (text, then each call's start and argument fragments, then finish), so the streamed and the
whole answer hold the same items. Each step returns the typed events it makes, in OpenAI's order:

    reasoning:      output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                    content_part.done, output_item.done   (with --reasoning-parser: the reasoning, first)
    message:        output_item.added, content_part.added, output_text.delta..., output_text.done,
                    content_part.done, output_item.done
    function call:  output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                    output_item.done

Text and calls keep the order the model wrote them: text after a call is another message item (message,
function_call, message), as the chat stream's chunks and the chat answer's parts (openai.Run.parts) give them;
the chat content's SEGMENT_SEP between them is not part of either message. A response with neither text nor
calls has one message with empty text (as chat answers content ""). A reasoning
item holds the whole reasoning as one `reasoning_text` part and no summary (the model writes none); it is sent
back as input on the next turn, where it is accepted and not rendered (responses/input.py).
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lmserve.parsers.tool_calls import SEGMENT_SEP, ToolCall
from lmserve.server.api.responses.input import ResponsesRequest, format_echo, tools_echo

Event = tuple[str, dict[str, Any]]  # (type, fields): the stream numbers them


class OutputItems:
    """A response's output items as they are generated; `items` is the output once finish() ran."""

    def __init__(self, message_id: str, reasoning_id: str) -> None:
        self.message_id, self.reasoning_id = message_id, reasoning_id
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (its status is "in_progress")

    def reasoning(self, delta: str) -> list[Event]:
        """Text of the reasoning item (opened on its first text)."""
        events = [] if self._is_open("reasoning") else self._start("reasoning", self.reasoning_id)
        self._open["content"][0]["text"] += delta
        return events + [("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": delta})]

    def text(self, delta: str) -> list[Event]:
        """Text of the assistant's message (opened on its first text; a later message, after a call, without the
        separator the chat content put before it)."""
        events = []
        if not self._is_open("message"):
            messages = sum(item["type"] == "message" for item in self.items)
            delta = delta.removeprefix(SEGMENT_SEP) if messages else delta
            events = self._start("message", self.message_id + (f"_{messages + 1}" if messages else ""))
        part = self._open["content"][0]
        part["text"] += delta
        return events + [("response.output_text.delta", {**self._where(), "content_index": 0, "delta": delta,
                                                           "logprobs": []})]

    def call(self, call_id: str, name: str) -> list[Event]:
        """A function call begins (it ends the message or call before it)."""
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": call_id, "name": name, "arguments": ""}
        return self._close("completed") + self._add(item)

    def arguments(self, delta: str) -> list[Event]:
        """A fragment of the open call's arguments."""
        self._open["arguments"] += delta
        return [("response.function_call_arguments.delta", {**self._where(), "delta": delta})]

    def finish(self, status: str) -> list[Event]:
        """The output is complete: `status` "completed", or "incomplete" when max_output_tokens cut it."""
        answered = any(item["type"] != "reasoning" for item in self.items)
        events = [] if answered else self._start("message", self.message_id)
        return events + self._close(status)

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})]

    def _start(self, kind: str, item_id: str) -> list[Event]:
        """A message or reasoning item and its one text part."""
        if kind == "message":
            item = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events = self._close("completed") + self._add(item)
        item["content"].append(part)
        return events + [("response.content_part.added", {**self._where(), "content_index": 0,
                                                           "part": copy.deepcopy(part)})]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where, events = self._where(), []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = (("response.output_text.done", {"logprobs": []}) if item["type"] == "message"
                    else ("response.reasoning_text.done", {}))
            events += [(done[0], {**where, "content_index": 0, "text": part["text"], **done[1]}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": copy.deepcopy(part)})]
        else:
            events.append(("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                     "arguments": item["arguments"]}))
        item["status"] = status
        self._open = None
        return events + [("response.output_item.done", {"output_index": where["output_index"],
                                                        "item": copy.deepcopy(item)})]


def output_of_chat(message: dict[str, Any], finish_reason: str | None, out: OutputItems,
                   parts: list[str | ToolCall] | None = None) -> list[dict[str, Any]]:
    """The output items of a whole chat answer's message: its reasoning, then its text and tool_calls in the order
    of `parts` (the chat answer's, openai.Run.parts) when it has calls, else its content then its tool_calls."""
    if message.get("reasoning_content"):
        out.reasoning(message["reasoning_content"])
    if parts and any(isinstance(p, ToolCall) for p in parts):
        for part in parts:
            if isinstance(part, ToolCall):
                out.call(part.id, part.name)
                out.arguments(part.arguments)
            else:
                out.text(part)
        out.finish(status_of(finish_reason))
        return out.items
    if message.get("content") or not message.get("tool_calls"):
        out.text(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        out.call(call["id"], call["function"]["name"])
        out.arguments(call["function"]["arguments"])
    out.finish(status_of(finish_reason))
    return out.items


def status_of(finish_reason: str | None) -> str:
    """The response's status for the chat answer's finish reason: "length" means max_output_tokens cut it."""
    return "incomplete" if finish_reason == "length" else "completed"


def usage_of(chat_usage: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    """The Response's usage from the chat answer's (its reasoning tokens when a reasoning parser ran)."""
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


@dataclass(frozen=True)
class ResponseShell:
    """What a Response object says besides its status, output and usage: its id, model, and the request's echo."""

    id: str
    model: str
    req: ResponsesRequest
    stored: bool  # store was asked for and this server keeps responses
    created_at: int = field(default_factory=lambda: int(time.time()))

    def object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object in `status` ("in_progress", "completed", "incomplete" or "failed")."""
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
                "store": self.stored, "temperature": req.temperature, "text": format_echo(req),
                "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": tools_echo(req),
                "top_p": req.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
                "metadata": req.metadata or {}}
