"""LLM: the offline API. `LLM().generate(prompts, params)` runs a list through the batching engine."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from tqdm import tqdm

from lmserve.config import (CacheConfig, EngineConfig, KVOffloadConfig, ParallelConfig, SchedulerConfig,
                            SpeculativeConfig)
from lmserve.engine.llm_engine import LLMEngine
from lmserve.request import CompletionDelta, TokenLogprobs
from lmserve.sampling_params import SamplingParams
from lmserve.utils import parse_bytes


@dataclass
class CompletionOutput:
    """One finished completion."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """All completions of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # with SamplingParams(prompt_logprobs=k): None for the first prompt token, then one entry per token
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    """Offline batch generation over the same engine the server uses."""

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **kwargs) -> None:
        """Load `model` (None: the embedded default) with vLLM-style keyword options, or wrap `engine`."""
        show_progress_logs()
        self.engine = engine or LLMEngine(_engine_config(model, kwargs))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) with continuous batching; results in input order.

        A text prompt is raw, as in vLLM: "<|im_start|>" written in it is the control token. To keep
        user text plain inside a chat template, use `chat` instead.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        outs: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, plist):
            rid = str(self._next_id)
            self._next_id += 1
            ids = self.engine.front.tokenize_prompt(prompt)
            self.engine.add_request(rid, ids, p)
            outs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                      [CompletionOutput(i, "", [], None, None, [] if p.logprobs is not None else None)
                                       for i in range(p.n)])
        self._run(outs, use_tqdm)
        return list(outs.values())

    def close(self) -> None:
        """Stop the engine's worker ranks (tensor parallelism); the LLM cannot generate afterwards."""
        self.engine.close()

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.encode_chat(c, add_generation_prompt=True) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, params, use_tqdm)

    def _run(self, outs: dict[str, RequestOutput], use_tqdm: bool) -> None:
        progress = _Progress(outs) if use_tqdm else None
        while self.engine.has_unfinished():
            deltas = self.engine.step()
            for d in deltas:
                if d.prompt_logprobs is not None and d.index == 0:
                    outs[d.request_id].prompt_logprobs = d.prompt_logprobs
                _accumulate(outs[d.request_id].outputs[d.index], d)
            if progress is not None:
                progress.update(deltas)
        if progress is not None:
            progress.close()


class _Progress:
    """The batch's bar on stderr, as vLLM draws it: prompts done and the estimated input/output tok/s."""

    REFRESH_S = 0.5  # the speed also moves between finished prompts (a batch that ends all at once)

    def __init__(self, outs: dict[str, RequestOutput]) -> None:
        self.completions_left = {rid: len(o.outputs) for rid, o in outs.items()}  # a prompt is done with its n-th
        self.prompt_tokens = {rid: len(o.prompt_token_ids) for rid, o in outs.items()}
        self.bar = tqdm(total=len(outs), desc="Processed prompts", unit="prompt", file=sys.stderr, dynamic_ncols=True)
        self.start = self.shown = time.perf_counter()
        self.input_tokens = self.output_tokens = 0

    def update(self, deltas: list[CompletionDelta]) -> None:
        done = 0
        for d in deltas:
            self.output_tokens += len(d.token_ids)
            if d.finished:
                self.completions_left[d.request_id] -= 1
                if self.completions_left[d.request_id] == 0:
                    done += 1
                    self.input_tokens += self.prompt_tokens[d.request_id]
        now = time.perf_counter()
        if done or now - self.shown >= self.REFRESH_S:
            self.shown = now
            self.bar.set_postfix_str(self._speed(now), refresh=not done)
            self.bar.update(done)

    def _speed(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        return f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, " \
               f"output: {self.output_tokens / elapsed:.2f} toks/s"

    def close(self) -> None:
        self.bar.close()


def show_progress_logs() -> None:
    """In a script that configured no logging, show lmserve's INFO lines (the first start's minute of
    kernel compilation, the model load) on stderr, as vLLM does; Python would drop them silently.

    Only when neither the root logger nor lmserve's has a handler, so an application's own logging
    setup (and pytest's capture) is left alone.
    """
    root, ours = logging.getLogger(), logging.getLogger("lmserve")
    if root.handlers or ours.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


def _accumulate(out: CompletionOutput, d: CompletionDelta) -> None:
    out.text += d.text
    out.token_ids.extend(d.token_ids)
    if out.logprobs is not None and d.logprobs:
        out.logprobs.extend(d.logprobs)
    if d.finished:
        out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason


def _engine_config(model: str | None, kw: dict) -> EngineConfig:
    """Flat keyword arguments (vLLM style) -> the nested frozen config."""
    cache_keys = {"block_size", "kv_cache_memory", "num_blocks", "enable_prefix_caching", "kv_cache_dtype"}
    sched_keys = {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"}
    cache = CacheConfig(**{k: kw.pop(k) for k in list(kw) if k in cache_keys})
    sched = SchedulerConfig(**{k: kw.pop(k) for k in list(kw) if k in sched_keys})
    spec = kw.pop("speculative_config", None)
    if isinstance(spec, dict):
        spec = SpeculativeConfig.from_dict(spec)
    parallel = ParallelConfig(**{k: kw.pop(k) for k in list(kw) if k in ("tensor_parallel_size", "rank_timeout_s")})
    offload = KVOffloadConfig(**{field: _size(kw.pop(k)) if field != "directory" else kw.pop(k)
                                 for k, field in _OFFLOAD_KEYS.items() if k in kw})
    return EngineConfig(model=model, cache=cache, scheduler=sched, speculative=spec, parallel=parallel,
                        kv_offload=offload, **kw)


# the KV tier's flags as keyword arguments: sizes as bytes or text ("2GiB")
_OFFLOAD_KEYS = {"kv_offload_memory": "memory_bytes", "kv_offload_dir": "directory", "kv_offload_disk_size": "disk_bytes"}


def _size(value: int | str) -> int:
    return parse_bytes(value) if isinstance(value, str) else int(value)
