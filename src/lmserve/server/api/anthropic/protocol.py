"""Request bodies of Anthropic's Messages API, and their translation into the chat the OpenAI path renders.

Accepted as Anthropic's API documents them: `system` (a string or text blocks), messages of text / tool_use /
tool_result / thinking blocks, custom `tools` with `tool_choice` auto / any / tool / none, `thinking`,
`metadata.user_id`, image blocks in user turns (base64 or url sources, checked by server/media.py), `cache_control` on blocks (prefix caching here is automatic, so it changes nothing). Refused
with a 400 naming the field: document blocks, image blocks outside user turns, server tools (`bash_20250124`, `web_search_...`), and a
final assistant message (Anthropic's "prefill": the chat templates here cannot continue a turn). An unknown
top-level field is ignored and named in X-Ignored-Fields, as on the OpenAI routes.

The translation (`chat_messages`, `openai_tools`, `openai_tool_choice`) produces OpenAI-shaped dicts, so the
one tool machinery (api/tools.py: prompt, grammar, parsing) serves both APIs.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from lmserve.server.media import image_url_part
from lmserve.server.protocol import MAX_MESSAGES, TOOL_NAME_PATTERN, _NullMeansDefault, _Strict


def _string_too(schema: dict[str, Any]) -> None:
    """The documented type of a block list: a string is allowed too (validation makes it one text block)."""
    options = schema.pop("anyOf", None) or [{k: schema.pop(k) for k in ("type", "items") if k in schema}]
    schema["anyOf"] = [{"type": "string"}, *options]


def _text_blocks(value: Any) -> Any:
    """A string where blocks may go, as its one text block (so the field has one type and an unknown field in a
    block is named and dropped as at the top level, not lost in a union's error)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class ContentBlock(_NullMeansDefault):
    """One content block; which fields it needs depends on `type` (one model: an unknown field is named plainly)."""

    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]
    text: str | None = None  # text
    id: str | None = Field(default=None, max_length=256)  # tool_use
    name: str | None = Field(default=None, pattern=f"^{TOOL_NAME_PATTERN}$")  # tool_use
    input: dict[str, Any] | None = None  # tool_use: the arguments object
    tool_use_id: str | None = Field(default=None, max_length=256)  # tool_result
    content: list[ContentBlock] | None = Field(default=None, json_schema_extra=_string_too)  # tool_result: text
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking (a past turn's: dropped, as Anthropic drops it)
    signature: str | None = None  # thinking
    data: str | None = None  # redacted_thinking
    source: dict[str, Any] | None = None  # image: {type: base64, media_type, data} or {type: url, url}; document: refused
    cache_control: dict[str, Any] | None = None  # accepted, changes nothing: prefix caching is automatic
    citations: list[dict[str, Any]] | None = None  # text: accepted in history

    @field_validator("content", mode="before")
    @classmethod
    def _content_text(cls, value: Any) -> Any:
        return _text_blocks(value)

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "ContentBlock":
        if self.type == "document":
            raise ValueError("document blocks are not supported")
        needed = {"image": ("source",), "text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                  "thinking": ("thinking",), "redacted_thinking": ("data",)}[self.type]
        missing = [f for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        if self.type == "image":
            image_url(self.source or {})  # the source's shape, checked here so the error names the block
        if self.content is not None and any(b.type != "text" for b in self.content):
            raise ValueError("a tool_result's content blocks must be text blocks")
        return self


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] = Field(json_schema_extra=_string_too)

    @field_validator("content", mode="before")
    @classmethod
    def _content_text(cls, value: Any) -> Any:
        return _text_blocks(value)

    @model_validator(mode="after")
    def _images_from_the_user(self) -> "Message":
        if self.role != "user" and any(b.type == "image" for b in self.content):
            raise ValueError("image blocks are accepted in user messages only")
        return self


class Tool(_Strict):
    """A client tool (`type` "custom" or absent); Anthropic's server tools are refused by `type`."""

    name: str = Field(pattern=f"^{TOOL_NAME_PATTERN}$")
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON schema whose type is "object"
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError('input_schema must be a JSON schema of "type": "object"')
        return schema


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only then')
        return self


class Thinking(_Strict):
    """Extended thinking: the template is told (`enable_thinking`); with --reasoning-parser the model's reasoning
    comes back as a `thinking` block, unless "disabled" (without `thinking` a reasoning model still reasons, and it
    is split out all the same). `budget_tokens` is enforced in the engine (structured/reasoning_budget.py): at most
    that many reasoning tokens, then "</think>" is forced and the answer follows. Anthropic's minimum is 1024; this
    server takes any budget >= 1 (a small model's tests, a short-thinking client), still below max_tokens."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)  # below max_tokens

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> "Thinking":
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('budget_tokens is required with type "enabled", and only then')
        return self


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=256)  # a --route's sticky choice, as OpenAI's `user`


class CountTokensRequest(_NullMeansDefault):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: list[ContentBlock] | None = Field(default=None, json_schema_extra=_string_too)
    # tools is declared before tool_choice: tool_choice's check reads the validated tools.
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text_blocks(cls, value: Any) -> Any:
        return _text_blocks(value)

    @field_validator("system")
    @classmethod
    def _system_text(cls, system: list[ContentBlock] | None) -> list[ContentBlock] | None:
        if system is not None and any(b.type != "text" for b in system):
            raise ValueError("system blocks must be text blocks")
        return system

    @field_validator("messages")
    @classmethod
    def _no_prefill(cls, messages: list[Message]) -> list[Message]:
        if messages[-1].role != "user":
            raise ValueError("the last message must be a user message (continuing an assistant turn, "
                             "Anthropic's prefill, is not supported)")
        return messages

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.name for t in tools or []]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"duplicate tool name {twice!r}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice is None or "tools" not in info.data:  # tools itself failed; that error is the one to report
            return choice
        names = [t.name for t in info.data["tools"] or []]
        if choice.type in ("any", "tool") and not names:
            raise ValueError(f'tool_choice "{choice.type}" needs a non-empty tools list')
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool {choice.name!r} is not in tools")
        return choice


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> "MessagesRequest":
        if self.thinking is not None and self.thinking.budget_tokens is not None \
                and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    @property
    def user(self) -> str | None:
        """metadata.user_id is what OpenAI's `user` is: whom a --route keeps on one model."""
        return self.metadata.user_id if self.metadata is not None else None


# -- translation -----------------------------------------------------------------------------------

def chat_messages(req: CountTokensRequest) -> list[dict]:
    """The conversation as OpenAI chat messages: tool_use blocks become `tool_calls`, tool_result blocks `tool`
    messages (before the turn's text, as Anthropic orders them), past thinking blocks are dropped."""
    out = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for m in req.messages:
        blocks = m.content
        if m.role == "assistant":
            out.append(_assistant(blocks))
            continue
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                for b in blocks if b.type == "tool_result"]
        if any(b.type in ("text", "image") for b in blocks) or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": _user_content(blocks)})
    return out


def image_url(source: dict[str, Any]) -> str:
    """An image block's source as a URL: base64 data as a data: URL of its media_type, or the url itself."""
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValueError("an image block's source must be {type: base64, media_type, data} or {type: url, url}")


def _user_content(blocks: list[ContentBlock]) -> str | list[dict]:
    """A user turn's text, or (with image blocks) its text and images in order as OpenAI chat parts."""
    if not any(b.type == "image" for b in blocks):
        return _text(blocks)
    return [image_url_part(image_url(b.source or {})) if b.type == "image" else {"type": "text", "text": b.text}
            for b in blocks if b.type in ("image", "text")]


def _assistant(blocks: list[ContentBlock]) -> dict:
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if b.type == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": _text(blocks)}
    return {**message, "tool_calls": calls} if calls else message


def _text(blocks: list[ContentBlock] | None) -> str:
    """The text of the text blocks, joined."""
    return "".join(b.text for b in blocks or [] if b.type == "text")


def openai_tools(req: CountTokensRequest) -> list[dict]:
    """The tools as OpenAI function dicts, when the model may call them (tools given, tool_choice not "none")."""
    if not req.tools or (req.tool_choice is not None and req.tool_choice.type == "none"):
        return []
    return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                              **({"description": t.description} if t.description else {})}}
            for t in req.tools]


def openai_tool_choice(choice: ToolChoice | None) -> str | dict:
    """auto -> "auto", any -> "required", tool -> the named function (none never gets here: no tools)."""
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "any":
        return "required"
    return {"type": "function", "function": {"name": choice.name}}
