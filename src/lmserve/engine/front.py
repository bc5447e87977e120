"""EngineFront: everything a request needs before it enters the engine, and what the server may know of it.

Tokenizing, the chat template, validation against the context and the KV pool, grammar compilation and
LoRA adapter lookup all happen here, on the caller's thread (the server's worker threads), never on the
engine thread; `requests()` then turns a checked prompt into the engine's Request objects (n completions
each). The server holds the front end, not the engine: it reads the model's limits and the engine's
load (`load()`) through it and never touches the scheduler or the KV pool. Every method is thread-safe.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, NamedTuple, Sequence

from lmserve.engine.build import EngineParts
from lmserve.engine.images import PromptImages, image_salt
from lmserve.engine.stats import EngineLoad
from lmserve.errors import RequestRejected
from lmserve.lora.registry import LoraRegistry
from lmserve.multimodal.processor import MMInput
from lmserve.multimodal.registry import processor_for, processor_from_settings
from lmserve.request import BlockSalt, EngineRequest, LoRARequest, Request
from lmserve.sampling_params import SamplingParams, VocabError
from lmserve.structured.compiler import Compiled, GrammarCompiler, GrammarError, VocabInfo
from lmserve.structured.grammar import Grammar, ReasoningGate
from lmserve.structured.limit import STEERED_KINDS, limit_steer
from lmserve.structured.reasoning_budget import ANSWER_SEPARATOR, ReasoningBudget
from lmserve.tokenizer import Tokenizer
from lmserve.tokenizer.bounds import text_bytes
from lmserve.tokenizer.tokenizer import RenderedChat


class PromptBounds(NamedTuple):
    """The fewest and most tokens a request's prompts can become, known from their bytes (tokenizer/bounds.py)."""

    fewest: int
    most: int


class EngineFront:
    """The model's tokenizer, limits and adapters, and the checks a request passes before it is queued."""

    def __init__(self, parts: EngineParts, load: Callable[[], EngineLoad]) -> None:
        self.cfg = parts.cfg
        self.tokenizer: Tokenizer = parts.tokenizer  # thread-safe: encode_chat, decode, id_to_piece...
        self.loras: LoraRegistry | None = parts.loras  # None: LoRA off
        self.loaded = parts.loaded  # path, load time, quantization and weight format (the model card, metrics)
        self.dtype, self.device = parts.dtype, parts.device
        self.vocab_size = parts.loaded.config.vocab_size
        self.hidden_size = parts.loaded.config.hidden_size  # an embedding's length
        self.pooler = parts.pooler  # how embedding requests pool (method, and where it was read from)
        self.tasks = parts.pooler.tasks  # what the model answers: generate, embed, score, rerank, classify
        self.max_model_len = parts.max_model_len
        self.max_num_seqs = parts.cfg.scheduler.max_num_seqs
        self.eos_token_ids = parts.eos_token_ids
        self.num_speculative_tokens = parts.cfg.speculative.num_speculative_tokens if parts.proposer else None
        self.load = load  # () -> EngineLoad: running and waiting requests, KV blocks, now
        self.block_size = parts.block_size
        self._blocks_needed = parts.kv.blocks_needed
        self._num_blocks = parts.num_blocks
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self._grammars_lock = threading.Lock()
        self.images = _prompt_images(parts)  # None: a text-only model (a request with images is refused)
        self.supports_images = self.images is not None  # a vision tower and its preprocessing: requests may hold images

    def _pool_need(self, need: int) -> str:
        """What a refused request needed, in blocks: a pool of several KV groups (sliding-window layers) holds its
        blocks over all of them, so its tokens (blocks x block size) overstated what one request could use."""
        return (f"{need} KV blocks of {self.block_size} tokens (over every KV group), more than the whole pool's "
                f"{self._num_blocks}")

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Prompt text -> ids (a raw prompt: "<|im_start|>" in it is the control token); ids are checked and kept."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestRejected("prompt must not be empty")
            return self.tokenizer.encode_prompt(prompt)
        ids = list(prompt)
        if not ids:
            raise RequestRejected("prompt must not be empty")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestRejected(f"prompt token id {t!r} is out of vocabulary (valid ids are 0..{vocab - 1})")
        return ids

    def prompt_bounds(self, prompts: list[str | RenderedChat | list[int]], params: SamplingParams) -> PromptBounds:
        """Bounds on the prompts' tokens from their UTF-8 length, without tokenizing them; RequestRejected when one
        cannot fit the context even at its fewest. Blocking (the first call builds the tokenizer's bounds)."""
        bounds, fewest, most = self.tokenizer.bounds, 0, 0
        for p in prompts:
            if isinstance(p, list):
                lo = hi = len(p)
            else:
                nbytes = p.nbytes if isinstance(p, RenderedChat) else text_bytes(p)
                lo, hi = bounds.lower(nbytes), bounds.upper(nbytes)
                self._check_fewest(lo, nbytes, params)
            fewest, most = fewest + lo, most + hi
        return PromptBounds(fewest, most)

    def _check_fewest(self, fewest: int, nbytes: int, params: SamplingParams) -> None:
        """check_request's context checks for a prompt known to have at least `fewest` tokens."""
        limit, what = self.max_model_len, f"prompt has at least {fewest} tokens ({nbytes} bytes)"
        if fewest > limit or (fewest == limit and params.pooling is None):
            raise RequestRejected(f"{what}, the model's context is {limit} tokens")
        if params.pooling is None and params.max_tokens is not None and fewest + params.max_tokens > limit:
            raise RequestRejected(f"{what} + max_tokens ({params.max_tokens}) exceeds the model's context of {limit} "
                                  "tokens")

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Raise RequestRejected when the request could never run; return its resolved max_tokens."""
        try:
            params.check_vocab(self.vocab_size)
        except VocabError as e:
            raise RequestRejected(str(e), e.param) from None
        n, limit = len(prompt_ids), self.max_model_len
        if params.pooling is not None:
            return self._check_pooling(n, params)
        if "generate" not in self.tasks:
            raise RequestRejected(f"this model does not generate text; it supports {', '.join(self.tasks)}", "model")
        if n >= limit:
            raise RequestRejected(f"prompt has {n} tokens, the model's context is {limit} tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise RequestRejected(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
                                  f"model's context of {limit} tokens")
        if (need := self._blocks_needed(n + max_tokens)) > self._num_blocks:
            raise RequestRejected(f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {self._pool_need(need)}")
        sched = self.cfg.scheduler
        if not sched.enable_chunked_prefill and n + max_tokens > sched.max_num_batched_tokens:
            raise RequestRejected(f"prompt + max_tokens exceeds max_num_batched_tokens "
                                  f"({sched.max_num_batched_tokens}) with chunked prefill off")
        return max_tokens

    def _check_pooling(self, n: int, params: SamplingParams) -> int:
        """A pooling request computes its prompt and nothing after it: the whole context is the prompt's."""
        dims = params.pooling.dimensions
        if dims is not None and dims > self.hidden_size:
            raise RequestRejected(f"dimensions ({dims}) exceeds the model's embedding size ({self.hidden_size})",
                                  "dimensions")
        if n > self.max_model_len:
            raise RequestRejected(f"input has {n} tokens, the model's context is {self.max_model_len} tokens",
                                  "prompt")
        if (need := self._blocks_needed(n)) > self._num_blocks:
            raise RequestRejected(f"input ({n} tokens) needs {self._pool_need(need)}", "prompt")
        if not self.cfg.scheduler.enable_chunked_prefill and n > self.cfg.scheduler.max_num_batched_tokens:
            raise RequestRejected(f"input exceeds max_num_batched_tokens ({self.cfg.scheduler.max_num_batched_tokens})"
                                  " with chunked prefill off", "prompt")
        return 1  # the one step past the prompt a Request's bookkeeping counts; never sampled

    def compile_grammar(self, params: SamplingParams) -> Compiled | None:
        """The compiled grammar of params.structured_outputs (None without one); blocking, thread-safe.

        The server calls it on a worker thread at admission; the offline path from add_request.
        """
        if params.structured_outputs is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                tok = self.tokenizer
                vocab = VocabInfo(tok.vocab_tokens(), tok.vocab_type, self.vocab_size, sorted(self.eos_token_ids))
                self._grammars = GrammarCompiler(vocab, self.cfg.structured)
        try:
            compiled = self._grammars.compile(params.structured_outputs)
            if params.structured_outputs.kind in STEERED_KINDS:  # the limit steer's table: built here, off the
                self._grammars.token_table()  # engine thread (~0.6 s, once)
            return compiled
        except GrammarError as e:
            raise RequestRejected(f"structured_outputs.{params.structured_outputs.kind}: {e}") from None

    def requests(self, request: EngineRequest) -> list[Request]:
        """The engine requests of one client request: its `params.n` completions, sharing the prompt.

        Its `max_tokens` is what check_request returned (None: checked here); its `grammar` what compile_grammar
        returned (None with structured_outputs: compiled here); its `lora` is already read (LoraRegistry.get).
        """
        params, lora = request.params, request.lora
        if lora is not None and self.loras is None:
            raise RequestRejected("this engine runs without LoRA (--enable-lora)", "model")
        ids = self.tokenize_prompt(request.prompt)
        ids, images = self._expand_images(ids, request.mm_inputs)
        max_tokens = request.max_tokens
        if max_tokens is None or images:  # the offline path (LLM, the CLI), or a prompt that images lengthened
            max_tokens = self.check_request(ids, params)
        grammar = request.grammar
        if grammar is None and params.structured_outputs is not None:
            grammar = self.compile_grammar(params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        # the client's own salt (vLLM's cache_salt) shares with every request sending it, whatever its scope; the
        # forms cannot collide: the server's scopes are b"" or b"key:" + a name without ':', a salt is never empty
        scope = b"salt:" + request.cache_salt.encode("utf-8") if request.cache_salt else request.prefix_scope
        salt = self._salt(lora, scope, images)
        gate = self._reasoning_gate(ids, params) if grammar is not None else None
        reuse = params.pooling is None or not self.pooler.needs_every_token
        return [Request.completion(request, i, ids, max_tokens, stop_ids, prefix_salt=salt, may_reuse_prefix=reuse,
                                   mm_inputs=images,
                                   reasoning_budget=self._reasoning_budget(ids, params, stop_ids, grammar is None),
                                   grammar=None if grammar is None else Grammar(grammar.grammar, stop_ids, gate,
                                                                                limit_steer(self._grammars, params)))
                for i in range(params.n)]

    def _salt(self, lora: LoRARequest | None, caller: bytes, images: tuple) -> bytes | BlockSalt:
        """The prompt's prefix-cache salt; with images, their digests join it from the block of the first image
        token on (the text before it stays shareable with every request of the same adapter and caller salt)."""
        plain = _prefix_salt(lora, caller)
        if not images:
            return plain
        first = min(int(m.positions[0]) for m in images)
        return BlockSalt(plain, _prefix_salt(lora, _with_images(image_salt(images), caller)), first // self.block_size)

    def _expand_images(self, ids: list[int], images: tuple[object, ...]) -> tuple[list[int], tuple]:
        """The prompt with each image's placeholder tokens in place of its marker, and the images as MMInputs
        (already so when the server expanded them at admission: `expand_images`)."""
        if not images:
            return ids, ()
        if all(isinstance(m, MMInput) for m in images):
            return ids, tuple(images)
        return self.expand_images(ids, images)

    def check_image_tokens(self, ids: list[int], sizes: Sequence[tuple[int, int]], params: SamplingParams) -> None:
        """check_request's length checks on the prompt as it will be with images of these (width, height)s, counted
        from the sizes alone: the server calls it before decoding any image, so a request past the context costs
        header reads, not decodes and resizes. Blocking (tokenizes each placeholder)."""
        self._check_images_allowed()
        self.check_request([0] * self.images.count(ids, sizes), params)

    def _check_images_allowed(self) -> None:
        if self.images is None:
            raise RequestRejected(f"this model ({self.loaded.config.architecture}) does not accept images", "messages")

    def expand_images(self, ids: list[int], images: Sequence[object]) -> tuple[list[int], tuple[MMInput, ...]]:
        """Prompt ids with its image markers -> the ids the model runs (each marker expanded) and one MMInput per
        image; RequestRejected for a text-only model or a marker count that differs from the images'. Blocking
        (preprocessing): the server calls it at admission, before the lengthened prompt is checked."""
        self._check_images_allowed()
        return self.images.expand(ids, images)

    def _reasoning_budget(self, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int],
                          separate: bool) -> ReasoningBudget | None:
        """One completion's reasoning budget (None: the request set none); each completion counts its own.
        `separate`: force ANSWER_SEPARATOR after a forced end tag; not under a grammar, whose first token must be
        its own (the grammar starts right after "</think>")."""
        if params.reasoning_budget is None or params.reasoning_tags is None:
            return None
        start, end, sep = (self.tokenizer.encode(text, add_special_tokens=False)
                           for text in (*params.reasoning_tags, ANSWER_SEPARATOR if separate else ""))
        return ReasoningBudget.for_prompt(prompt_ids, start, end, params.reasoning_budget, self.vocab_size, stop_ids,
                                          sep)

    def _reasoning_gate(self, prompt_ids: list[int], params: SamplingParams) -> ReasoningGate | None:
        """What holds a grammar back until the reasoning ends (None: it applies from the first token)."""
        if params.reasoning_tags is None:
            return None
        start, end = (self.tokenizer.encode(tag, add_special_tokens=False) for tag in params.reasoning_tags)
        return ReasoningGate.for_prompt(prompt_ids, start, end)


def _prefix_salt(lora: LoRARequest | None, salt: bytes) -> bytes:
    """The adapter first (blocks never cross adapters), then the caller's salt after a NUL: the adapter part holds
    no NUL, so no two (adapter, salt) pairs give the same bytes.

    An adapter is named by the digest of its files (the same in every process, so the KV tier's disk files of one
    adapter serve that adapter alone after a restart); one read without a digest by its registration id and this
    process's nonce (ids restart at every start: such blocks must never outlive the process).
    """
    if lora is None:
        adapter = b""
    elif getattr(lora.adapter, "digest", ""):
        adapter = b"lora:" + lora.adapter.digest.encode()
    else:
        adapter = b"lora-id:%d:%s" % (lora.lora_int_id, _PROCESS_NONCE)
    return adapter + b"\0" + salt if salt else adapter


_PROCESS_NONCE = os.urandom(8).hex().encode()


def _with_images(images: bytes, salt: bytes) -> bytes:
    """The images' part of the salt, length-prefixed, then the caller's: no caller salt can spell another
    prompt's images (a text-only request must never read the KV computed from an image it lacks)."""
    return b"%d:" % len(images) + images + salt if images else salt


def _prompt_images(parts: EngineParts) -> PromptImages | None:
    """The served model's image preprocessing, from its directory (None: a text-only model)."""
    path, mm = parts.loaded.path, parts.loaded.mmproj
    if mm is not None:  # a text GGUF and its projector file: the settings its metadata gave (loader/mmproj.py)
        proc = processor_from_settings(parts.loaded.config.architecture, mm.preprocessor, mm.processor)
    else:
        proc = processor_for(parts.loaded.config.architecture, path if path.is_dir() else None)
    return None if proc is None else PromptImages(proc, parts.tokenizer)
