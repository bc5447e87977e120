"""API request fields -> SamplingParams, with 400s naming the field (validation before the engine)."""

from __future__ import annotations

from pydantic import BaseModel

from lmserve.parsers.reasoning import effort_budget
from lmserve.parsers.tool_formats import HERMES, ToolFormat
from lmserve.parsers.tool_grammar import tool_call_tag
from lmserve.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams, StructuredOutputsParams
from lmserve.server.config import TokenLimits
from lmserve.server.errors import APIError, excerpt
from lmserve.server.protocol import ChatRequest, CompletionRequest, _Sampling
from lmserve.structured.compiler import GrammarError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _named(r: BaseModel, name: str) -> int | None:
    """A field the request set (nulls count as unset: _NullMeansDefault drops them), else None."""
    return getattr(r, name) if name in r.model_fields_set else None


def _api_default(r: BaseModel, name: str) -> int | None:
    return type(r).model_fields[name].default


def build_params(**kw) -> SamplingParams:
    """SamplingParams, its ValueError a 400 naming the field."""
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        raise APIError(400, msg, param=msg.split(" ")[0].rstrip(":")) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys -> token ids (plain ASCII digits only: int() would take " 5", "1_0" or "٣")."""
    if not bias:
        return None
    bad = next((k for k in bias if not (k.isascii() and k.isdigit() and len(k) < 12)), None)
    if bad is not None:
        raise APIError(400, f"logit_bias keys must be token ids (integers as strings), got {excerpt(bad)}",
                       param="logit_bias")
    return {int(k): v for k, v in bias.items()}


def structured_spec(r: _Sampling) -> dict | None:
    """response_format / structured_outputs / guided_* -> StructuredOutputsParams fields; at most one source."""
    sources = {}
    fmt = r.response_format
    if fmt is not None and fmt.type == "json_object":
        sources["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema
        sources["response_format"] = {"json": schema if schema is not None else {"type": "object"}}
    if r.structured_outputs is not None:
        body = r.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        sources["structured_outputs"] = body
    guided = {kind: getattr(r, name) for name, kind in _GUIDED.items() if getattr(r, name) is not None}
    if guided:
        sources[next(name for name in _GUIDED if getattr(r, name) is not None)] = guided
    if len(sources) > 1:
        raise APIError(400, f"set only one of {', '.join(sources)}: each constrains the output",
                       param=list(sources)[1])
    return next(iter(sources.values()), None)


def structured_params(spec: dict | None, param: str) -> StructuredOutputsParams | None:
    if spec is None:
        return None
    try:
        return StructuredOutputsParams.from_dict(spec)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


def tool_dicts(r: ChatRequest) -> list[dict]:
    """The request's tools as OpenAI dicts when the model may call them (tools given, tool_choice not "none")."""
    if not r.tools or r.tool_choice == "none":
        return []
    return [t.model_dump(exclude_none=True) for t in r.tools]


def _tool_spec(r: ChatRequest, fmt: ToolFormat) -> dict | None:
    """Tools make the output text with grammar-constrained calls (auto) or calls only (required, named), in `fmt`."""
    tools = tool_dicts(r)
    if not tools:
        return None
    choice = r.tool_choice if r.tool_choice is not None else "auto"
    if not isinstance(choice, str):
        choice = choice.model_dump()
    return tool_structure(tools, choice, parallel=r.parallel_tool_calls is not False, fmt=fmt.name)


def tool_structure(tools: list[dict], choice: str | dict, parallel: bool, fmt: str = HERMES.name) -> dict:
    """The structured-output spec that constrains calls to OpenAI `tools` under an OpenAI `tool_choice` ("auto",
    "required" or a named function) in tool-call format `fmt`; 400 naming `tools` when a tool's schema cannot be
    enforced."""
    try:
        return {"structural_tag": tool_call_tag(tools, choice, parallel, fmt)}
    except GrammarError as e:
        raise APIError(400, str(e), param="tools") from None


def _sampling_params(r: _Sampling, structured: dict | None = None, **fields) -> SamplingParams:
    """The body's SamplingParams: the fields completions and chat share, read from it here, and each's own
    `fields`; `structured`: the output constraint when not the body's own (chat's tools)."""
    bias = _logit_bias(r.logit_bias)
    if r.stream_options is not None and not r.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    structured = structured if structured is not None else structured_spec(r)
    return build_params(structured_outputs=structured_params(structured, "structured_outputs"),
                        n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                        presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                        repetition_penalty=r.repetition_penalty, logit_bias=bias, seed=r.seed, stop=stop,
                        stop_token_ids=list(r.stop_token_ids or []), min_tokens=r.min_tokens, ignore_eos=r.ignore_eos,
                        **fields)


# Completions fields beam search does not combine with (beams are ranked by their raw logprobs, as vLLM's): set to
# anything but their default, each is a 400 naming it.
_NOT_WITH_BEAMS = ("stream", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "logit_bias", "stop", "stop_token_ids", "min_tokens", "logprobs", "echo", "prompt_logprobs",
                   "suffix", "response_format", "structured_outputs", *_GUIDED)


def beam_params(r: CompletionRequest, limits: TokenLimits = TokenLimits()) -> BeamSearchParams:
    """vLLM's `use_beam_search` fields -> BeamSearchParams: width best_of (or n), the best n returned; 400s name
    the field (n > best_of, temperature > 0, a sampling option beams ignore, streaming)."""
    for name in _NOT_WITH_BEAMS:
        value = getattr(r, name)
        if value is not None and value != _api_default(r, name) and value not in ([], {}, ""):
            raise APIError(400, f"{name} is not supported with use_beam_search", param=name)
    if r.best_of is not None and r.n > r.best_of:
        raise APIError(400, f"n ({r.n}) must be <= best_of ({r.best_of}) with use_beam_search", param="n")
    if "temperature" in r.model_fields_set and r.temperature != 0:
        raise APIError(400, f"temperature must be 0 (or unset) with use_beam_search, got {r.temperature}",
                       param="temperature")
    build_params(n=r.n, ignore_eos=r.ignore_eos)  # n's bounds, as any completions request
    max_tokens = limits.resolve(_named(r, "max_tokens"), _api_default(r, "max_tokens"), "max_tokens")
    try:
        return BeamSearchParams(beam_width=r.best_of or r.n, max_tokens=max_tokens, ignore_eos=r.ignore_eos,
                                length_penalty=r.length_penalty, early_stopping=r.early_stopping)
    except ValueError as e:
        name = str(e).split(" ")[0]
        raise APIError(400, str(e), param="best_of" if name == "beam_width" else name) from None


def completion_params(r: CompletionRequest, limits: TokenLimits = TokenLimits()) -> SamplingParams:
    if r.best_of not in (None, 1):
        raise APIError(400, f"best_of > 1 is not supported without use_beam_search (got {r.best_of}); use n",
                       param="best_of")
    for name in ("length_penalty", "early_stopping"):
        if getattr(r, name) != _api_default(r, name):
            raise APIError(400, f"{name} applies only with use_beam_search", param=name)
    if r.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if r.max_tokens == 0 and not r.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 is allowed with echo, to score the prompt)",
                       param="max_tokens")
    # The engine needs max_tokens >= 1: it samples one token that the route drops (as vLLM does). Prefill
    # produces that token anyway, so scoring costs one sampled row and no extra forward pass.
    max_tokens = limits.resolve(_named(r, "max_tokens"), _api_default(r, "max_tokens"), "max_tokens")
    max_tokens = 1 if scores_prompt_only(r) else max_tokens
    # echo with logprobs covers the prompt's tokens too (OpenAI's legacy scoring); vLLM's extra asks directly.
    prompt_logprobs = r.prompt_logprobs if r.prompt_logprobs is not None else r.logprobs if r.echo else None
    return _sampling_params(r, max_tokens=max_tokens, logprobs=r.logprobs, prompt_logprobs=prompt_logprobs)


def scores_prompt_only(r: CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt (and its logprobs) comes back, nothing is generated."""
    return r.echo and r.max_tokens == 0


def chat_params(r: ChatRequest, limits: TokenLimits = TokenLimits(), fmt: ToolFormat = HERMES,
                plan_fields: dict | None = None) -> SamplingParams:
    """A chat request's SamplingParams: tools constrained in `fmt`; `plan_fields` are the chat plan's
    (api/chat_plan.py: the reasoning tags any grammar waits for, whether special tokens stay in the text); a
    `reasoning_effort` budgets the reasoning where the plan names its tags (as chat_plan.with_budget)."""
    if r.use_beam_search:
        raise APIError(400, "use_beam_search is supported on /v1/completions (and LLM.beam_search), not on chat",
                       param="use_beam_search")
    if r.top_logprobs is not None and not r.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {r.top_logprobs}", param="top_logprobs")
    param = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    max_tokens = limits.resolve(_named(r, param), _api_default(r, param), param)
    tools, other = _tool_spec(r, fmt), structured_spec(r)
    if tools is not None and other is not None:
        raise APIError(400, "response_format and structured outputs cannot be combined with tools "
                       '(unless tool_choice is "none")', param="tools")
    plan_fields = plan_fields or {}
    if plan_fields.get("reasoning_tags") is not None:
        plan_fields = {**plan_fields, "reasoning_budget": effort_budget(r.reasoning_effort, max_tokens)}
    return _sampling_params(r, tools or other, max_tokens=max_tokens,
                            logprobs=(r.top_logprobs or 0) if r.logprobs else None, **plan_fields)
