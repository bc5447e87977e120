"""LLM: the offline API. `LLM().generate(prompts, params)` runs a list through the batching engine,
`LLM().embed(prompts)` pools them (worker/pooler.py) and `LLM().beam_search(prompts, params)` drives
beam_search.py, all as vLLM spells them; adapters by `lora_request=`."""

from __future__ import annotations

import base64
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from tqdm import tqdm

from lmserve.beam_search import BeamSearch, BeamSearchOutput, advance_all, next_batch
from lmserve.config import (
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    LoraConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from lmserve.engine.llm_engine import LLMEngine
from lmserve.multimodal.image_io import load_image_bytes
from lmserve.pooling_params import PoolingParams
from lmserve.request import CompletionDelta, LoRARequest, TokenLogprobs
from lmserve.sampling_params import BeamSearchParams, SamplingParams
from lmserve.units import parse_bytes


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
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (vLLM's field), when done


@dataclass
class EmbeddingOutput:
    """One prompt's vector (L2-normalised unless PoolingParams(normalize=False))."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, as vLLM names it: `.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


Prompts = str | dict | Sequence[str | dict] | Sequence[list[int]]
Adapters = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """Offline batch generation over the same engine the server uses."""

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **kwargs) -> None:
        """Load `model` (None: the embedded default) with vLLM-style keyword options, or wrap `engine`."""
        show_progress_logs()
        self.engine = engine or LLMEngine(_engine_config(model, kwargs))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Adapters = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) with continuous batching; results in input order.

        A prompt with images is vLLM's dict: {"prompt": text or "prompt_token_ids": ids, "multi_modal_data":
        {"image": one PIL image or a list}}, each image marked in the prompt by the model's image token
        (SmolVLM: "<image>"), in order. A text prompt is raw, as in vLLM: "<|im_start|>" written in it is the control token. To keep
        user text plain inside a chat template, use `chat` instead. `lora_request`: one adapter for every
        prompt, or one (or None) per prompt; the LLM needs `enable_lora=True`.
        """
        prompts = _as_list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        outs = self._submit(prompts, plist, lora_request)
        self._run(outs, use_tqdm)
        return list(outs.values())

    def embed(self, prompts: Prompts, *, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              lora_request: Adapters = None, truncate_prompt_tokens: int | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, pooled as the model's checkpoint (or --pooling) says; results in input order.

        The prompts are prefilled in the same batches as generations and nothing is sampled.
        `truncate_prompt_tokens`: keep only each prompt's last k tokens (vLLM's option).
        """
        prompts = _as_list(prompts)
        if truncate_prompt_tokens is not None:
            prompts = [self.engine.front.tokenize_prompt(p)[-truncate_prompt_tokens:] for p in prompts]
        params = SamplingParams(max_tokens=1, pooling=pooling_params or PoolingParams())
        outs = self._submit(prompts, [params] * len(prompts), lora_request)
        vectors = self._run(outs, use_tqdm)
        return [EmbeddingRequestOutput(rid, o.prompt_token_ids, EmbeddingOutput(vectors[rid]))
                for rid, o in outs.items()]

    def beam_search(self, prompts: Prompts | Sequence[dict], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...});
        one BeamSearchOutput per prompt, its `beam_width` sequences best first.

        Each step runs every live beam of every prompt as one batch of one-token requests; their shared prefixes
        come from the prefix cache (beam_search.py). `use_tqdm` is accepted for vLLM's signature.
        """
        front, adapter = self.engine.front, self._adapter(lora_request)
        searches = []
        for prompt in [prompts] if isinstance(prompts, dict) else _as_list(prompts):
            ids = front.tokenize_prompt(_prompt_of(prompt))
            max_tokens = front.check_request(ids, SamplingParams(max_tokens=params.max_tokens))
            searches.append(BeamSearch(ids, params, front.eos_token_ids, max_tokens))
        while (batch := next_batch(searches))[0]:
            advance_all(searches, self._next_token_logprobs(*batch, adapter))
        return [s.outputs(front.tokenizer.decode) for s in searches]

    def _next_token_logprobs(self, seqs: list[list[int]], plist: list[SamplingParams],
                             adapter: LoRARequest | None) -> list[list[tuple[int, float]]]:
        """Run each sequence as a one-token request (in one batch); each one's top (token id, logprob), best first."""
        rids = []
        for ids, p in zip(seqs, plist):
            rids.append(str(self._next_id))
            self._next_id += 1
            self.engine.add_request(rids[-1], ids, p, lora=adapter)
        tops: dict[str, list[tuple[int, float]]] = {}
        while self.engine.has_unfinished():
            for d in self.engine.step():
                if d.logprobs:
                    tops[d.request_id] = d.logprobs[0].top
        return [tops[rid] for rid in rids]

    def _submit(self, prompts: list, plist: Sequence[SamplingParams], lora_request: Adapters
                ) -> dict[str, RequestOutput]:
        """Queue every prompt with its params and adapter; their outputs to fill, by request id."""
        adapters = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError("give one lora_request, or one per prompt")
        outs: dict[str, RequestOutput] = {}
        for prompt, p, adapter in zip(prompts, plist, adapters):
            rid = str(self._next_id)
            self._next_id += 1
            text, images = _prompt_of(prompt), _images_of(prompt)
            ids = self.engine.front.tokenize_prompt(text)
            self.engine.add_request(rid, ids, p, lora=self._adapter(adapter), mm_inputs=images)
            outs[rid] = RequestOutput(rid, text if isinstance(text, str) else None, ids,
                                      [CompletionOutput(i, "", [], None, None, [] if p.logprobs is not None else None)
                                       for i in range(p.n)])
        return outs

    def _adapter(self, req: LoRARequest | None) -> LoRARequest | None:
        """The engine's adapter for vLLM's LoRARequest: registered under its name on first use, then reused."""
        if req is None:
            return None
        loras = self.engine.front.loras
        if loras is None:
            raise ValueError("lora_request needs an LLM made with enable_lora=True")
        known = loras.lookup(req.lora_name)
        if known is None:
            return loras.register(req.lora_name, req.lora_path)
        if known.path != str(req.lora_path):
            raise ValueError(f"adapter {req.lora_name!r} is already registered from {known.path}")
        return loras.get(req.lora_name)

    def close(self) -> None:
        """Stop the engine's worker ranks (tensor parallelism); the LLM cannot generate afterwards."""
        self.engine.close()

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        A message's content may hold image parts: {"type": "image", "image": PIL}, vLLM's {"type": "image_pil",
        "image_pil": PIL}, or {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}; each becomes
        the model's image token in the message text. Such a conversation is rendered, then encoded as a raw prompt
        (special-token strings parsed, as `generate` encodes text): the offline caller writes its own messages.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list = []
        for conv in convs:
            conv, images = _chat_images(conv, self.engine.front.images)  # type: ignore[arg-type]
            if images:
                text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
            else:
                prompts.append(self.tokenizer.encode_chat(conv, add_generation_prompt=True))
        return self.generate(prompts, params, use_tqdm)

    def _run(self, outs: dict[str, RequestOutput], use_tqdm: bool) -> dict[str, list[float]]:
        """Step until every request has finished; returns the pooling requests' vectors by request id."""
        progress = _Progress(outs) if use_tqdm else None
        vectors: dict[str, list[float]] = {}
        while self.engine.has_unfinished():
            deltas = self.engine.step()
            for d in deltas:
                if d.embedding is not None:
                    vectors[d.request_id] = d.embedding
                if d.prompt_logprobs is not None and d.index == 0:
                    outs[d.request_id].prompt_logprobs = d.prompt_logprobs
                if d.finished and d.index == 0:
                    outs[d.request_id].num_cached_tokens = d.num_cached_tokens
                _accumulate(outs[d.request_id].outputs[d.index], d)
            if progress is not None:
                progress.update(deltas)
        if progress is not None:
            progress.close()
        return vectors


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


def _as_list(prompts: Prompts) -> list:
    """One prompt (text or token ids) or a list of them -> a list."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _prompt_of(prompt: str | list[int] | dict) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt dicts -> the text or the ids."""
    if isinstance(prompt, dict):
        return prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    return prompt


def _images_of(prompt: str | list[int] | dict) -> tuple[object, ...]:
    """vLLM's `multi_modal_data["image"]`: one image or a list of them, in the order of their markers."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not data:
        return ()
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(unknown)}")
    images = data["image"]
    return tuple(images) if isinstance(images, (list, tuple)) else (images,)


def _chat_images(messages: list[dict], vision: object | None) -> tuple[list[dict], list[object]]:
    """The conversation with each image part as `{"type": "image"}`, and the images in order: the chat template
    writes its placeholder (Qwen2.5-VL's wraps its marker in `<|vision_start|>`/`<|vision_end|>`), as the server's
    (server/media.py split_images) does."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "image_pil", "image_url"):
                if vision is None:
                    raise ValueError("this model does not accept images")
                images.append(_part_image(part, kind))
                part = {"type": "image"}
            parts.append(part)
        out.append({**m, "content": parts})
    return out, images


def _part_image(part: dict, kind: str) -> object:
    """One image part's image: a PIL image as given, or a `data:` URL decoded (load_image_bytes checks it)."""
    if kind != "image_url":
        return part[kind]
    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
    head, sep, data = str(url).partition(",")
    if not (head.startswith("data:") and head.endswith(";base64") and sep):
        raise ValueError("offline chat takes images as PIL images or base64 data: URLs")
    return load_image_bytes(base64.b64decode(data, validate=True))


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
    lora = _lora_config(kw)
    spec = kw.pop("speculative_config", None)
    if isinstance(spec, dict):
        spec = SpeculativeConfig.from_dict(spec)
    parallel_keys = ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_micro_batches", "rank_timeout_s")
    parallel = ParallelConfig(**{k: kw.pop(k) for k in list(kw) if k in parallel_keys})
    offload = KVOffloadConfig(**{field: _size(kw.pop(k)) if field.endswith("bytes") else kw.pop(k)
                                 for k, field in _OFFLOAD_KEYS.items() if k in kw})
    return EngineConfig(model=model, cache=cache, scheduler=sched, speculative=spec, parallel=parallel,
                        kv_offload=offload, lora=lora, **kw)


def _lora_config(kw: dict) -> LoraConfig | None:
    """vLLM's enable_lora, max_loras, max_cpu_loras, max_lora_rank, lora_dtype keywords -> LoraConfig (None: LoRA
    off)."""
    keys = {k: kw.pop(k) for k in ("max_loras", "max_cpu_loras", "max_lora_rank", "lora_dtype") if k in kw}
    if not kw.pop("enable_lora", False):
        if keys:
            raise ValueError(f"{', '.join(keys)} need enable_lora=True")
        return None
    if "lora_dtype" in keys:  # a name, or torch.float16 as vLLM takes it
        keys["dtype"] = str(keys.pop("lora_dtype")).removeprefix("torch.")
    return LoraConfig(**keys)


# the KV tier's flags as keyword arguments: sizes as bytes or text ("2GiB")
_OFFLOAD_KEYS = {"kv_offload_memory": "memory_bytes", "kv_offload_dir": "directory", "kv_offload_disk_size": "disk_bytes",
                 "kv_shared": "shared", "kv_shared_ttl": "shared_ttl_s", "kv_shared_size": "shared_bytes"}


def _size(value: int | str) -> int:
    return parse_bytes(value) if isinstance(value, str) else int(value)
