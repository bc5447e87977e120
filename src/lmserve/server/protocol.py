"""Request models for the OpenAI and TGI APIs. Unknown fields are rejected, never silently ignored."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmserve.server.errors import APIError, excerpt

MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_MESSAGES = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat (OpenAI names plus vLLM's extras)."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=256)
    # extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TGIParameters(_Strict):
    max_new_tokens: int | None = 100
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    do_sample: bool = False
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False


class TGIRequest(_Strict):
    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Strict JSON (no NaN/Infinity) into `model`, with errors that name the field."""
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> APIError:
    unknown = [".".join(map(str, err["loc"])) for err in e.errors() if err["type"] == "extra_forbidden"]
    if unknown:
        return APIError(400, f"unsupported field(s): {', '.join(unknown[:5])}", param=unknown[0],
                        code="unsupported_field")
    errors = e.errors()
    err = errors[0]
    top = str(err["loc"][0]) if err["loc"] else "body"
    if top in UNION_FIELDS and len({str(x["loc"][0]) for x in errors}) == 1 and len(errors) > 1:
        return APIError(400, f"{top} must be {UNION_FIELDS[top]}", param=top)
    loc = ".".join(str(x) for x in err["loc"])
    return APIError(400, f"{loc}: {err['msg']} (got {excerpt(err.get('input'))})", param=loc)
