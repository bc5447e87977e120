"""API request fields -> SamplingParams, with 400s naming the field (validation before the engine)."""

from __future__ import annotations

from lmserve.sampling_params import MAX_LOGPROBS, SamplingParams
from lmserve.server.errors import APIError, excerpt
from lmserve.server.protocol import ChatRequest, CompletionRequest, TGIParameters, _Sampling


def _build(**kw) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        raise APIError(400, msg, param=msg.split(" ")[0]) from None


def _common(r: _Sampling) -> dict:
    bias = None
    if r.logit_bias:
        try:
            bias = {int(k): v for k, v in r.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings), got "
                           f"{excerpt(next(iter(r.logit_bias)))}", param="logit_bias") from None
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    return dict(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                repetition_penalty=r.repetition_penalty, logit_bias=bias, seed=r.seed, stop=stop,
                stop_token_ids=list(r.stop_token_ids or []), min_tokens=r.min_tokens, ignore_eos=r.ignore_eos)


def completion_params(r: CompletionRequest) -> SamplingParams:
    if r.best_of not in (None, 1) and r.best_of != r.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if r.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if r.echo and r.logprobs is not None:
        raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported", param="echo")
    return _build(max_tokens=r.max_tokens, logprobs=r.logprobs, **_common(r))


def chat_params(r: ChatRequest) -> SamplingParams:
    if r.top_logprobs is not None and not r.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {r.top_logprobs}", param="top_logprobs")
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    return _build(max_tokens=max_tokens, logprobs=(r.top_logprobs or 0) if r.logprobs else None, **_common(r))


def tgi_params(p: TGIParameters) -> SamplingParams:
    """TGI semantics: greedy unless do_sample (or a sampling knob) is set."""
    sampling = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p))
    temperature = (p.temperature if p.temperature is not None else 1.0) if sampling else 0.0
    return _build(max_tokens=p.max_new_tokens, temperature=temperature, top_k=p.top_k or 0,
                  top_p=p.top_p if p.top_p is not None else 1.0,
                  repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
                  stop=p.stop, seed=p.seed, logprobs=0 if p.details else None)
