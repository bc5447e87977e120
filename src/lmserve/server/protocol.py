"""Request models for the OpenAI API (and the shared bases every dialect's bodies build on).

A field no model here declares is ignored, as vLLM does (clients and SDKs of a newer API version send fields
this server does not know): it is logged and named in the response's X-Ignored-Fields header; with
`--strict-fields` it is a 400 instead. A field that is declared but unsupported (`suffix`, `best_of` > 1 without beam search, ...)
is always a 400 naming it: it would change the answer.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from lmserve.server.errors import APIError, excerpt

MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_MESSAGES = 256
MAX_JSON_DEPTH = 128  # arrays/objects inside each other in a body: a JSON schema 60 levels deep still fits
# OpenAI takes 300; this leaves room to ban most of a 49k vocabulary (a grammar does that better) and refuses a
# 100k-key bomb when it is parsed, before the per-key checks in Python
MAX_LOGIT_BIAS = 2**16
TOOL_NAME_PATTERN = r"[A-Za-z0-9_-]{1,64}"  # OpenAI's rule for function names
# Marks a body field that does not change the answer (how it is delivered, who asked, a cache's own switch): the
# response cache's key leaves it out (answer_neutral; server/api/cache_replay.py).
ANSWER_NEUTRAL = "answer-neutral"


def answer_neutral(model: type[BaseModel]) -> frozenset[str]:
    """The fields of a body model marked ANSWER_NEUTRAL."""
    return frozenset(name for name, f in model.model_fields.items() if ANSWER_NEUTRAL in f.metadata)


class _Strict(BaseModel):
    # strict: "10" is not an int and 2.0 is not a token id, as in OpenAI's own API. defer_build: a model's validator
    # is built on its first body, not at import (every API family's models: ~0.05 CPU s of a start, issue 32).
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)


class _NullMeansDefault(_Strict):
    """Clients send unset options as null: a null field (even an unsupported one) counts as absent."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaSpec(_Strict):
    """response_format.json_schema: OpenAI's named schema ("schema" is the JSON schema itself)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        return self


class StructuredOutputsBody(_NullMeansDefault):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class _Sampling(_NullMeansDefault):
    """Fields shared by completions and chat (OpenAI names plus vLLM's extras)."""

    model: str | None = None  # none: the default (first) served model, as vLLM serves its one model
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: Annotated[bool, ANSWER_NEUTRAL] = False
    stream_options: Annotated[StreamOptions | None, ANSWER_NEUTRAL] = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: Annotated[str | None, ANSWER_NEUTRAL] = Field(default=None, max_length=256)
    # extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's older names for structured_outputs, still sent by many clients
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # lmserve: false skips the response cache (--response-cache) for this request
    cache: Annotated[bool | None, ANSWER_NEUTRAL] = None
    # vLLM's: the prompt's prefix-cache blocks are shared only with requests sending the same salt (any key's)
    cache_salt: Annotated[str | None, ANSWER_NEUTRAL] = Field(default=None, min_length=1, max_length=256)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: a choice-level list, top-k per prompt token
    # vLLM's beam search extras: best_of (or n) beams, the best n returned (server/api/params.beam_params)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data: URL, or an http(s) URL of an --allowed-media-domains host (server/media.py checks it)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """An image in a user message: OpenAI's {"type": "image_url", "image_url": {"url", "detail"}} (or the URL alone)."""

    type: Literal["image_url"]
    image_url: ImageURL | str


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallMessage(_Strict):
    """One call in an assistant message's `tool_calls` (history sent back by the client)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None  # which call a tool message answers

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content must not be null in a {self.role} message")
        return self

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed in assistant messages, not in a {self.role} message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id is required in a tool message" if self.role == "tool"
                             else f"tool_call_id is only allowed in tool messages, not in a {self.role} message")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=f"^{TOOL_NAME_PATTERN}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments object
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice that forces one function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: ToolName


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # tools is declared before tool_choice: tool_choice's check reads the validated tools.
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension: extra variables for the chat template (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning effort: with --reasoning-parser, a reasoning budget (parsers/reasoning.py EFFORT_BUDGETS)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    use_beam_search: bool = False  # vLLM's field: declared so that it is refused (a 400), never silently ignored

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & {"messages", "add_generation_prompt", "tools"})
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields do)")
        return kwargs

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        seen: set[str] = set()
        for tool in tools or []:
            if tool.function.name in seen:
                raise ValueError(f"duplicate function name {tool.function.name!r}")
            seen.add(tool.function.name)
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: str | NamedToolChoice | None, info: ValidationInfo) -> Any:
        if "tools" not in info.data:  # tools itself failed; that error is the one to report
            return choice
        names = [t.function.name for t in info.data["tools"] or []]
        wanted = "'required'" if choice == "required" else "a named function" if isinstance(choice, NamedToolChoice) \
            else None
        if wanted is not None and not names:
            raise ValueError(f"{wanted} needs a non-empty tools list")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"function {choice.function.name!r} is not in tools")
        return choice


# An adapter name is what clients send as `model`: short, printable, no spaces.
LORA_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"


class LoadLoraAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's body): read a PEFT adapter under --lora-dir and serve it as lora_name."""

    lora_name: str = Field(pattern=LORA_NAME)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's body): stop serving lora_name (requests using it finish first)."""

    lora_name: str = Field(pattern=LORA_NAME)


class BatchCreateRequest(_NullMeansDefault):
    """POST /v1/batches: run an uploaded file's lines against one endpoint."""

    input_file_id: str = Field(max_length=100)
    endpoint: str = Field(max_length=100)
    completion_window: Literal["24h"] = "24h"  # OpenAI's only window; jobs here run as soon as the queue allows
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # with messages: rendered as a chat request with these tools would be
    add_special_tokens: bool = True
    content: str | None = None  # llama.cpp's /tokenize: the text, answered as {"tokens": [...]} only
    add_special: bool = False  # llama.cpp's flag for `content` (its default: no BOS)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text and image_url parts",
    "tool_choice": "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf without passing through parse_constant
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """True if any string holds half a UTF-16 pair ("\\ud800"): no tokenizer can encode it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def _depth_over(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests deeper than `limit` arrays/objects (iterative: no recursion to blow)."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def load_json(raw: bytes) -> Any:
    """Strict JSON: no NaN/Infinity/overflowing numbers, no lone surrogates, bounded nesting."""
    try:
        data = json.loads(raw, parse_constant=_no_constants, parse_float=_finite_float)
        # The walk runs only when an escaped surrogate appears at all (rare outside emoji).
        lone = re.search(rb"\\u[dD][89a-fA-F]", raw) is not None and _has_lone_surrogate(data)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {str(e)[:120]}") from None
    if lone:
        raise APIError(400, "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string")
    # json.loads nests as deep as Python's recursion limit; pydantic and the payload log stop well before.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth_over(data, MAX_JSON_DEPTH):
        raise APIError(400, f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    return data


def parse_body(raw: bytes, model: type[BaseModel], strict: bool = True, ignored: list[str] | None = None) -> Any:
    """Strict JSON into `model`, with errors that name the field (see parse_data for `strict` and `ignored`)."""
    return parse_data(load_json(raw), model, strict, ignored)


def parse_data(data: Any, model: type[BaseModel], strict: bool = True, ignored: list[str] | None = None) -> Any:
    """Parsed JSON (it must be an object) into `model`, with errors that name the field.

    strict: an unknown field is a 400. Otherwise unknown fields (top-level, or inside a plain nested object such as
    stream_options) are dropped and their dotted names appended to `ignored`; one inside a union's branch (a
    message of some role) still fails, since which branch it belongs to is not known.
    """
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    while True:
        try:
            return model.model_validate(data)
        except ValidationError as e:
            unknown = [err["loc"] for err in e.errors() if err["type"] == "extra_forbidden"]
            if strict or not unknown or not all(_drop(data, loc) for loc in unknown):
                raise _validation_error(e) from None
            if ignored is not None:
                ignored += [".".join(map(str, loc))[:40] for loc in unknown]


def _drop(data: Any, loc: tuple) -> bool:
    """Delete the field at `loc` (keys and list indices) from the parsed body; False where the path is not there."""
    for part in loc[:-1]:
        ok = isinstance(data, dict) and part in data or isinstance(data, list) and isinstance(part, int) \
            and 0 <= part < len(data)
        if not ok:
            return False
        data = data[part]
    if not isinstance(data, dict) or loc[-1] not in data:
        return False
    del data[loc[-1]]
    return True


def _validation_error(e: ValidationError) -> APIError:
    errors = e.errors()
    union = _union_error(errors)
    if union is not None:
        return union
    unknown = [".".join(map(str, err["loc"]))[:40] for err in errors if err["type"] == "extra_forbidden"]
    if unknown:
        return APIError(400, f"unsupported field(s): {', '.join(unknown[:5])}", param=unknown[0],
                        code="unsupported_field")
    err = errors[0]
    loc = ".".join(str(x) for x in err["loc"])[:100] or "body"
    msg = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{loc}: {msg} (got {excerpt(err.get('input'))})", param=loc)


def _union_error(errors: list[dict]) -> APIError | None:
    """One clear sentence when every error is a branch of the same union field failing."""
    loc = errors[0]["loc"]
    for k, part in enumerate(loc):
        if part in UNION_FIELDS:
            prefix = loc[:k + 1]
            if len(errors) > 1 and all(err["loc"][:k + 1] == prefix for err in errors):
                path = ".".join(map(str, prefix))
                return APIError(400, f"{path} must be {UNION_FIELDS[part]}", param=path)
            return None
    return None
