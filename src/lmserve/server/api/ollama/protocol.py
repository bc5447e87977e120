"""The Ollama API's request bodies, and what they mean here: options -> SamplingParams, `format` -> the structured
output spec, `tools` -> the tool-call grammar, messages -> the chat (OpenAI-shaped dicts, as server/api/tools.py
renders them), `keep_alive` -> seconds.

What differs from the OpenAI routes, as Ollama does it: sampling defaults are Ollama's (temperature 0.8, top_k 40,
top_p 0.9); `num_predict` -1 or -2 runs to the end of the context; a negative `seed` is a random one; tool calls
come with `arguments` as an object; a tool result names its function (`tool_name`), not a call id. Options
Ollama knows that change nothing here (GPU layers, threads, mmap, mirostat...) are accepted and logged.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, Protocol, Union

from pydantic import Field, field_validator

from lmserve.sampling_params import SamplingParams
from lmserve.server.api.params import build_params, structured_params, tool_structure
from lmserve.server.config import TokenLimits
from lmserve.server.errors import APIError
from lmserve.server.media import image_url_part
from lmserve.server.protocol import MAX_MESSAGES, ToolDef, _NullMeansDefault, _Strict
from lmserve.units import parse_duration

log = logging.getLogger("lmserve.server")

# Ollama's runner defaults (api/types.go DefaultOptions) for what a request leaves unset.
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.9
# Options Ollama takes that change nothing here: how its runner loads and batches, and samplers this one lacks.
IGNORED_OPTIONS = ("num_keep", "typical_p", "repeat_last_n", "penalize_newline", "mirostat", "mirostat_tau",
                   "mirostat_eta", "tfs_z", "num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock",
                   "num_thread", "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "embedding_only")
LATEST = ":latest"  # Ollama's default tag: "smollm2:latest" names the served model "smollm2"


class Options(_NullMeansDefault):
    """`options`: the sampling knobs that apply, then Ollama's others (accepted, logged, ignored)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    num_predict: int | None = None  # -1: no limit (the context's end); -2: fill the context
    stop: str | list[str] | None = None
    seed: int | None = None  # negative: a random seed
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_keep: Any = None
    typical_p: Any = None
    repeat_last_n: Any = None
    penalize_newline: Any = None
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    tfs_z: Any = None
    num_ctx: Any = None  # the context is the server's --max-model-len
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    num_thread: Any = None
    numa: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    logits_all: Any = None
    vocab_only: Any = None
    embedding_only: Any = None


class ToolFunctionCall(_Strict):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, as Ollama sends it (not JSON text)
    index: int | None = None


class ToolCall(_NullMeansDefault):
    function: ToolFunctionCall
    id: str | None = None
    type: Literal["function"] | None = None


class Message(_NullMeansDefault):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # base64 images (after the text, as Ollama renders them): user messages only
    thinking: str | None = None  # an earlier reply's reasoning: not rendered back into the prompt
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # which function a tool message answers
    tool_call_id: str | None = None


Format = Union[Literal["", "json"], dict[str, Any]]
Think = Union[bool, Literal["low", "medium", "high"]]


class _Request(_NullMeansDefault):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1, max_length=256)
    format: Format | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | float | None = None  # Ollama's duration: "5m", seconds, 0 (unload now), negative (never)
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("model")
    @classmethod
    def _untagged(cls, name: str) -> str:
        return name.removesuffix(LATEST) or name

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)  # none: load the model only
    tools: list[ToolDef] | None = None


class GenerateRequest(_Request):
    prompt: str = ""  # empty (and no context): load the model only
    system: str | None = None
    suffix: str | None = None  # refused: no fill-in-the-middle
    template: str | None = None  # refused: the model's own chat template renders the prompt
    context: list[int] | None = None  # an earlier answer's `context`: the conversation so far, as token ids
    raw: bool = False  # the prompt as written, no template
    images: list[str] | None = None


class ShowRequest(_NullMeansDefault):
    model: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=256)  # the older spelling
    verbose: bool = False


class KeepAliveBody(Protocol):
    """An Ollama body with a `keep_alive`: chat and generate here, embed and embeddings in server/api/embeddings."""

    keep_alive: str | float | None


def keep_alive_seconds(req: KeepAliveBody) -> float | None | Literal[False]:
    """The request's keep_alive in seconds (None: forever); False when it gave none (the server's default holds)."""
    if req.keep_alive is None:
        return False
    try:
        return parse_duration(req.keep_alive)
    except ValueError as e:
        raise APIError(400, f"keep_alive: {e}", param="keep_alive") from None


def sampling_params(req: _Request, limits: TokenLimits, tools: list[dict] | None = None,
                    fmt: str = "hermes", plan_fields: dict | None = None) -> SamplingParams:
    """Options, format, tools and logprobs -> SamplingParams, Ollama's defaults where the request is silent;
    `plan_fields` are the chat plan's (api/chat_plan.py: `format` and tools wait for the reasoning's end)."""
    o = req.options or Options()
    ignored = sorted(k for k in o.model_fields_set if k in IGNORED_OPTIONS)
    if ignored:
        log.info("ollama options accepted and ignored (no effect on this server): %s", ", ".join(ignored))
    if o.num_predict is not None and (o.num_predict == 0 or o.num_predict < -2):
        raise APIError(400, f"options.num_predict must be -1 (no limit), -2 (fill the context) or >= 1, got "
                       f"{o.num_predict}", param="options.num_predict")
    asked = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
    return build_params(max_tokens=limits.resolve(asked, None, "options.num_predict"),
                        temperature=_or(o.temperature, DEFAULT_TEMPERATURE), top_k=_or(o.top_k, DEFAULT_TOP_K),
                        top_p=_or(o.top_p, DEFAULT_TOP_P), min_p=_or(o.min_p, 0.0),
                        repetition_penalty=_or(o.repeat_penalty, 1.0), presence_penalty=_or(o.presence_penalty, 0.0),
                        frequency_penalty=_or(o.frequency_penalty, 0.0),
                        seed=o.seed if o.seed is not None and o.seed >= 0 else None, stop=stop,
                        logprobs=(req.top_logprobs or 0) if req.logprobs or req.top_logprobs else None,
                        structured_outputs=structured_params(_constraint(req.format, tools, fmt), "format"),
                        **(plan_fields or {}))


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _constraint(fmt: Format | None, tools: list[dict] | None, call_format: str = "hermes") -> dict | None:
    """`format` ("json" or a JSON schema) or the tools' call grammar (text with calls, as tool_choice "auto")."""
    if tools and fmt:
        raise APIError(400, "format cannot be combined with tools (each constrains the output)", param="format")
    if tools:
        return tool_structure(tools, "auto", True, call_format)
    if fmt == "json":
        return {"json_object": True}
    return {"json": fmt} if fmt else None


def chat_messages(messages: list[Message]) -> list[dict]:
    """Ollama messages -> the OpenAI-shaped dicts tools.prepare_chat renders (call ids made up where Ollama has
    none: a tool result answers the oldest unanswered call to its `tool_name`)."""
    out: list[dict] = []
    pending: list[tuple[str, str]] = []  # (call id, function name) of calls not answered yet
    for i, m in enumerate(messages):
        if m.images and m.role != "user":
            raise APIError(400, f"images are accepted in user messages only, not in a {m.role} message",
                           param=f"messages.{i}.images")
        message: dict[str, Any] = {"role": m.role, "content": with_images(m.content, m.images)}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"tool_calls is only allowed in assistant messages, not in a {m.role} message",
                               param=f"messages.{i}.tool_calls")
            calls = [_call(c, f"call_{i}_{k}") for k, c in enumerate(m.tool_calls)]
            pending += [(c["id"], c["function"]["name"]) for c in calls]
            message["tool_calls"] = calls
        if m.role == "tool":
            call_id, name = _answered(pending, m)
            message.update(tool_call_id=call_id, **({"name": name} if name else {}))
        out.append(message)
    return out


def with_images(text: str, images: list[str] | None) -> str | list[dict]:
    """A user turn's content: its text, or its text then its images as OpenAI chat parts (bare base64 as a data:
    URL of no declared type: server/media.py reads the format from the bytes)."""
    if not images:
        return text
    urls = [b64 if b64.startswith("data:") else f"data:;base64,{b64}" for b64 in images]
    return [*([{"type": "text", "text": text}] if text else []), *(image_url_part(u) for u in urls)]


def _call(c: ToolCall, made_up_id: str) -> dict:
    arguments = json.dumps(c.function.arguments, ensure_ascii=False)
    return {"id": c.id or made_up_id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}}


def _answered(pending: list[tuple[str, str]], m: Message) -> tuple[str, str | None]:
    """(call id, function name) a tool message answers, taken off `pending`."""
    for k, (call_id, name) in enumerate(pending):
        if call_id == m.tool_call_id or (m.tool_call_id is None and (m.tool_name is None or m.tool_name == name)):
            del pending[k]
            return call_id, name
    return m.tool_call_id or "call_unmatched", m.tool_name


def think_kwargs(think: Think | None, template_variables: frozenset[str]) -> dict[str, Any]:
    """`think` as the chat template's own switches: `enable_thinking` (Qwen3, SmolLM3, ...) and a level as
    `reasoning_effort` (gpt-oss), where the template reads them; elsewhere it changes nothing (logged).

    With --reasoning-parser the routes split the reasoning out into `message.thinking` / `thinking` unless `think`
    is false (api/chat_plan.py); without one they leave `thinking` out.
    """
    if think is None:
        return {}
    kwargs: dict[str, Any] = {}
    if "enable_thinking" in template_variables:
        kwargs["enable_thinking"] = bool(think)
    if isinstance(think, str) and "reasoning_effort" in template_variables:
        kwargs["reasoning_effort"] = think
    if not kwargs:
        log.info("ollama think=%s ignored: this model's chat template has no thinking switch", think)
    return kwargs
