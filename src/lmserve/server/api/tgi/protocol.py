"""TGI's request bodies, and their parameters -> SamplingParams (TGI's own rules, 400s naming the field)."""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import Field

from lmserve.sampling_params import SamplingParams
from lmserve.server.api.params import _api_default, _named, build_params, structured_params
from lmserve.server.config import TokenLimits
from lmserve.server.errors import APIError
from lmserve.server.protocol import _NullMeansDefault, _Strict


class TGIGrammar(_Strict):
    """TGI's parameters.grammar: a JSON schema (`json`, value an object or its text) or a `regex`."""

    type: Literal["json", "regex"]
    value: dict[str, Any] | str


class TGIParameters(_NullMeansDefault):
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
    decoder_input_details: bool = False  # the prompt's tokens and logprobs in details.prefill
    watermark: bool = False  # only false; huggingface_hub sends it on every request
    grammar: TGIGrammar | None = None
    adapter_id: str | None = Field(default=None, max_length=128)  # a LoRA adapter's name (TGI/LoRAX); None: base


class TGIRequest(_Strict):
    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)


class TGICompatRequest(TGIRequest):
    """POST / (what huggingface_hub's InferenceClient calls): /generate or /generate_stream by `stream`."""

    stream: bool = False


def tgi_params(p: TGIParameters, stream: bool, limits: TokenLimits = TokenLimits()) -> SamplingParams:
    """TGI semantics: greedy unless do_sample or a sampling knob away from neutral; a sampled request gets a seed."""
    if p.watermark:
        raise APIError(400, "watermark is not supported", param="watermark")
    if p.decoder_input_details and stream:  # TGI's own rule
        raise APIError(400, "decoder_input_details is not supported when streaming tokens",
                       param="decoder_input_details")
    if p.temperature is not None and p.temperature <= 0:
        raise APIError(400, f"temperature must be strictly positive, got {p.temperature}", param="temperature")
    # As TGI's NextTokenChooser: any warper away from its neutral value turns sampling on.
    warpers = p.temperature not in (None, 1.0) or p.top_k not in (None, 0) or p.top_p not in (None, 1.0)
    sampling = p.do_sample or warpers
    seed = p.seed if p.seed is not None or not sampling else secrets.randbits(63)  # reported in details, as TGI
    grammar = None
    if p.grammar is not None:
        grammar = structured_params({"json" if p.grammar.type == "json" else "regex": p.grammar.value}, "grammar")
    max_tokens = limits.resolve(_named(p, "max_new_tokens"), _api_default(p, "max_new_tokens"), "max_new_tokens")
    return build_params(max_tokens=max_tokens, temperature=(p.temperature or 1.0) if sampling else 0.0,
                  top_k=p.top_k or 0, top_p=p.top_p if p.top_p is not None else 1.0,
                  repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
                  stop=p.stop, seed=seed, logprobs=0 if p.details or stream else None,
                  prompt_logprobs=0 if p.details and p.decoder_input_details else None, structured_outputs=grammar)
