"""OpenAI's stream chunks and the SSE framing of every API family's streams: the one encoder, used by live streams
and by the response cache's replay of a stored answer (so a replayed stream is shaped exactly as a live one)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterable

from starlette.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def event(chunk: dict) -> str:
    """One server-sent event carrying `chunk` as JSON."""
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def named_event(name: str, data: dict) -> str:
    """One server-sent event with an `event:` name (Anthropic's stream: the name repeats data's `type`)."""
    return f"event: {name}\n" + event(data)


def typed_event(chunk: dict) -> str:
    """One server-sent event named by its chunk's `type` (`event: response.created`), as typed streams send them."""
    return named_event(chunk["type"], chunk)


def response(events: AsyncIterator[str] | Iterable[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    """An SSE response (no caching or proxy buffering: each event reaches the client as it is made)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


def chat_chunk(base: dict, index: int, delta: dict, logprobs: Any = None, reason: str | None = None) -> dict:
    """A chat.completion.chunk of one choice; `base` holds id, object, created and model."""
    return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


def role_chunk(base: dict, index: int) -> dict:
    """The first chunk of a chat choice: the assistant's role and empty content."""
    return chat_chunk(base, index, {"role": "assistant", "content": ""})


def completion_chunk(meta: dict, choice: dict) -> dict:
    """A text_completion chunk of one choice."""
    return {**meta, "choices": [choice]}


def usage_chunk(meta: dict, usage: dict) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the request's usage."""
    return {**meta, "choices": [], "usage": usage}


def replay(answer: dict, include_usage: bool) -> list[str]:
    """A stored whole answer as the events a live stream sends: per choice its text (chat: the role first, the
    reasoning, the content or tool calls, then the finish reason), the usage if asked, then [DONE]."""
    chat = answer.get("object") == "chat.completion"
    meta = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    chunks = [c for choice in answer["choices"]
              for c in (_chat_choice(meta, choice) if chat else [completion_chunk(meta, choice)])]
    if include_usage:
        chunks.append(usage_chunk(meta, answer["usage"]))
    return [event(c) for c in chunks] + [DONE]


def _chat_choice(meta: dict, c: dict) -> list[dict]:
    message, i = c["message"], c["index"]
    chunks = [role_chunk(meta, i)]
    if message.get("reasoning_content"):
        chunks.append(chat_chunk(meta, i, {"reasoning_content": message["reasoning_content"]}))
    if message.get("content"):
        chunks.append(chat_chunk(meta, i, {"content": message["content"]}, c.get("logprobs")))
    if message.get("tool_calls"):
        calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        chunks.append(chat_chunk(meta, i, {"tool_calls": calls}))
    chunks.append(chat_chunk(meta, i, {}, None, c["finish_reason"]))
    return chunks
