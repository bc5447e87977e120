"""The /v1/responses answer: output items built from a chat answer, the Response object, and the stream's events.

`OutputItems` is the one builder of a response's `output`, fed the same way by a whole chat answer and by
a chat stream (text, then each call's start and argument fragments, then finish), so the streamed and the
whole answer hold the same items. Each step returns the typed events it makes, in OpenAI's order:

    message:        output_item.added, content_part.added, output_text.delta..., output_text.done,
                    content_part.done, output_item.done
    function call:  output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                    output_item.done

A response with neither text nor calls has one message with empty text (as chat answers content "").
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lmserve.server.api.responses_input import ResponsesRequest, format_echo, tools_echo

Event = tuple[str, dict[str, Any]]  # (type, fields): the stream numbers them


class OutputItems:
    """A response's output items as they are generated; `items` is the output once finish() ran."""

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (its status is "in_progress")

    def text(self, delta: str) -> list[Event]:
        """Text of the assistant's message (opened on its first text)."""
        events = [] if self._is_open("message") else self._start_message()
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
        events = self._start_message() if not self.items else []
        return events + self._close(status)

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})]

    def _start_message(self) -> list[Event]:
        item = {"id": self.message_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        events = self._close("completed") + self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return events + [("response.content_part.added", {**self._where(), "content_index": 0,
                                                           "part": copy.deepcopy(part)})]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where, events = self._where(), []
        if item["type"] == "message":
            part = item["content"][0]
            events += [("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                      "logprobs": []}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": copy.deepcopy(part)})]
        else:
            events.append(("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                     "arguments": item["arguments"]}))
        item["status"] = status
        self._open = None
        return events + [("response.output_item.done", {"output_index": where["output_index"],
                                                        "item": copy.deepcopy(item)})]


def output_of_chat(message: dict[str, Any], finish_reason: str | None, message_id: str) -> list[dict[str, Any]]:
    """The output items of a whole chat answer's message (its content, then its tool_calls)."""
    out = OutputItems(message_id)
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


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


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
                "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": self.stored, "temperature": req.temperature, "text": format_echo(req),
                "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": tools_echo(req),
                "top_p": req.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
                "metadata": req.metadata or {}}
