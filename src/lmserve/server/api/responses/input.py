"""The /v1/responses request: its body, its input items, and their translation into a chat request.

A Responses request becomes the chat request it means (server/api/openai.start_chat runs it): `instructions`
a first system message, input items chat messages, `tools` (flat function tools) chat tools, `text.format`
chat's response_format, `max_output_tokens` max_completion_tokens. Input items:

    {"role": ..., "content": str | [parts]}                a message ("type": "message" may be given); an
                                                           input_image part becomes chat's image_url part
    {"type": "function_call", "call_id", "name", "arguments"}   a call the model made earlier
    {"type": "function_call_output", "call_id", "output"}       its result
    {"type": "reasoning", "summary", "content"?}                 an earlier turn's reasoning: kept, not rendered

Consecutive function calls join the assistant message before them (as one chat message holds its text and
its tool_calls); a call's output is a tool message; a reasoning item is dropped from the prompt, as chat templates
drop past turns' reasoning. Items are kept normalised, with ids (`msg_`, `fc_`,
`fco_` + hex, unless the client gave one), as GET /v1/responses/{id}/input_items lists them.

Items are validated one by one against the model of their `type`, so an error names the item
(`input.2.call_id`) and an unknown field inside an item is ignored and named in X-Ignored-Fields like any
other (a 400 with --strict-fields); inside a content part it is a 400, as inside a chat message's parts.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator, model_validator

from lmserve.server.errors import APIError
from lmserve.server.media import image_url_part
from lmserve.server.protocol import TOOL_NAME_PATTERN, _NullMeansDefault, _Strict, parse_data

MAX_ITEMS = 256  # input items of one request (chat's MAX_MESSAGES: each item is at most one message)
# include entries that ask for parts of items this server never produces: nothing to add, so accepted.
# "message.output_text.logprobs" would change the answer and is refused.
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                               "web_search_call.action.sources", "message.input_image.image_url",
                               "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class InputImage(_NullMeansDefault):
    """An image in a user message: a data: URL or an allowed http(s) URL (server/media.py); file ids are refused."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"

    @model_validator(mode="after")
    def _by_url(self) -> "InputImage":
        if self.file_id is not None:
            raise ValueError("file_id images are not supported; send image_url (a data: URL or an http(s) URL)")
        if self.image_url is None:
            raise ValueError("an input_image needs image_url")
        return self


class OutputText(_NullMeansDefault):
    """An assistant message's text, sent back as history (the Agents SDK keeps annotations and logprobs)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[Union[InputText, InputImage, OutputText, Refusal], Field(discriminator="type")]


class MessageItem(_NullMeansDefault):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = Field(default=None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_NullMeansDefault):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=f"^{TOOL_NAME_PATTERN}$")
    arguments: str
    id: str | None = Field(default=None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_NullMeansDefault):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str | list[InputText]
    id: str | None = Field(default=None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("output", mode="wrap")
    @classmethod
    def _output(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list:
        try:  # one error naming "output", not one per branch of the union
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string or a list of input_text parts") from None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_NullMeansDefault):
    """An earlier answer's reasoning item, sent back as history (the Agents SDK does): accepted, not rendered."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    id: str | None = Field(default=None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    encrypted_content: str | None = None  # OpenAI's sealed reasoning: accepted and, like the rest, not rendered


ITEM_MODELS = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class FunctionTool(_NullMeansDefault):
    """A Responses function tool: flat, where chat nests it under "function"."""

    type: Literal["function"]
    name: str = Field(pattern=f"^{TOOL_NAME_PATTERN}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_NullMeansDefault):
    """text.format: plain text, any JSON object, or JSON matching a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError('type "json_schema" needs a name and a schema')
        return self


class TextConfig(_NullMeansDefault):
    format: TextFormat | None = None


class ReasoningConfig(_NullMeansDefault):
    """`reasoning`: `effort` becomes a reasoning budget (chat's reasoning_effort); summaries are not written."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary


class ResponsesRequest(_NullMeansDefault):
    """POST /v1/responses (OpenAI's Responses API; the fields this server runs)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...} (checked below)
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=128)
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None  # OpenAI's Conversations API and stored prompts: refused, as ignoring them would
    prompt: Any = None  # drop context the client expects the answer to see

    @field_validator("input", mode="wrap")
    @classmethod
    def _some_input(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list:
        try:  # one error naming "input", not one per branch of the union
            value = handler(value)
        except ValidationError:
            raise ValueError("must be a string or a list of input items (objects)") from None
        if isinstance(value, list) and not 1 <= len(value) <= MAX_ITEMS:
            raise ValueError(f"must hold 1 to {MAX_ITEMS} items")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError('"auto" (dropping the oldest items to fit the context) is not supported; a request '
                             "that does not fit is refused")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _not_offered(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("is not supported by this server (continue a conversation with previous_response_id)")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background mode is not supported: a response runs while its request waits")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any) -> Any:
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"} \
                and isinstance(choice["name"], str):
            return choice
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "name": ...}')

    @field_validator("include")
    @classmethod
    def _include(cls, include: list[str] | None) -> list[str] | None:
        unsupported = [entry for entry in include or [] if entry not in HARMLESS_INCLUDES]
        if unsupported:
            raise ValueError(f"{unsupported[0][:60]!r} is not supported")
        return include


def input_items(req: ResponsesRequest, strict: bool, ignored: list[str]) -> list[dict[str, Any]]:
    """The request's input as validated, normalised items, each with an id (a string is one user message)."""
    raw = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    return [_item(data, i, strict, ignored) for i, data in enumerate(raw)]


def _item(data: dict[str, Any], i: int, strict: bool, ignored: list[str]) -> dict[str, Any]:
    kind = data.get("type", "message")
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(400, f"input.{i}.type: {str(kind)[:60]!r} items are not supported (only "
                       f"{', '.join(ITEM_MODELS)})", param=f"input.{i}.type")
    dropped: list[str] = []
    try:
        item = parse_data(data, model, strict, dropped)
    except APIError as e:  # name the item: "input.2.call_id: ..."
        located = e.param is not None and e.message.startswith(e.param)
        raise APIError(400, f"input.{i}.{e.message}" if located else f"input.{i}: {e.message}",
                       param=f"input.{i}.{e.param}" if e.param else f"input.{i}", code=e.code) from None
    ignored += [f"input.{i}.{name}" for name in dropped]
    body = item.model_dump(exclude_none=True, by_alias=True)
    body["id"] = body.get("id") or f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"
    if kind == "message":
        body["content"] = _parts(body["content"], body["role"])
    return body


def _parts(content: str | list[dict], role: str) -> list[dict]:
    """Content as a list of parts (a string: one input_text part, or output_text in an assistant message)."""
    if isinstance(content, list):
        return content
    if role == "assistant":
        return [{"type": "output_text", "text": content, "annotations": []}]
    return [{"type": "input_text", "text": content}]


def _text(parts: str | list[dict]) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(p["refusal"] if p["type"] == "refusal" else p["text"] for p in parts)


def _content(parts: list[dict]) -> str | list[dict]:
    """A message's parts as chat content: its text, or (with an input_image) text and image_url parts in order."""
    if not any(p["type"] == "input_image" for p in parts):
        return _text(parts)
    return [image_url_part(p["image_url"], p["detail"]) if p["type"] == "input_image"
            else {"type": "text", "text": _text([p])} for p in parts]


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages that `items` (after `instructions`, a system message) mean."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _content(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the text or calls before it: one turn
                last["tool_calls"] = [*last.get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        # a reasoning item: not rendered (templates drop past turns' reasoning)
    return messages


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body this request means (parsed by the caller as a ChatRequest)."""
    body: dict[str, Any] = {"model": req.model, "messages": messages, "temperature": req.temperature,
                            "top_p": req.top_p, "stream": req.stream, "user": req.user,
                            "max_completion_tokens": req.max_output_tokens,
                            "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None}
    if req.stream:  # the usage chunk ends the chat stream; response.completed carries it
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
        body["parallel_tool_calls"] = req.parallel_tool_calls
        choice = req.tool_choice
        if isinstance(choice, dict) and choice["name"] not in {t.name for t in req.tools}:
            raise APIError(400, f"tool_choice: function {choice['name'][:64]!r} is not in tools", param="tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}} \
            if isinstance(choice, dict) else choice
    elif req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice: 'required' or a named function needs a non-empty tools list",
                       param="tool_choice")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict, "description": fmt.description}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return {k: v for k, v in body.items() if v is not None}


def format_echo(req: ResponsesRequest) -> dict[str, Any]:
    """The Response object's `text`: the format it ran with (plain text unless text.format said otherwise)."""
    fmt = req.text.format if req.text is not None else None
    return {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt is not None else {"type": "text"}}


def tools_echo(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The Response object's `tools`, as OpenAI echoes them (strict defaults to true in the Responses API)."""
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
             "strict": t.strict if t.strict is not None else True} for t in req.tools or []]
