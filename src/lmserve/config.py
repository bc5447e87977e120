"""Engine configuration: one frozen dataclass per subsystem, composed into EngineConfig."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lmserve.errors import ConfigError

VERSION = "0.1.0"  # lmserve.__version__; kept here, plain data, so that packages below the facade may read it
# torch's OpenMP runtime (libgomp) spins at its barriers in this process: torch was imported before lmserve, whose
# package __init__ sets OMP_WAIT_POLICY=PASSIVE for libgomp to read when torch loads it (it imports this module
# first), and the user chose no policy. engine/build.py says so once.
TORCH_FIRST_SPINS = "torch" in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)

if TYPE_CHECKING:
    import argparse

ENV_API_KEY = "LMSERVE_API_KEY"  # accepted API keys, comma-separated (`lmserve serve`)


DEFAULT_KV_CACHE_FRACTION = 0.15  # of the memory available when the engine starts, when no size is given


@dataclass(frozen=True)
class CacheConfig:
    """KV cache size and layout."""

    block_size: int = 16
    # bytes if > 1, else a fraction of the memory available when the engine starts; None: the default fraction
    kv_cache_memory: float | None = None
    num_blocks: int | None = None  # overrides kv_cache_memory (tests use tiny pools)
    # CUDA, when neither size is given: the fraction of the GPU's memory for weights + activations + KV cache;
    # the KV cache gets what a profiled forward of a full step leaves of it (cache/sizing.gpu_kv_budget)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # auto: float16 where the weights are a GGUF file's kept blocks on CPU (llama.cpp's default KV type: half
    # the bytes every decode step reads), else the model's dtype; float32 | float16 force one
    kv_cache_dtype: str = "auto"
    # sliding-window layers in KV groups of their own that release the blocks their window left (cache/kv_groups.py);
    # False: every layer keeps every block (vLLM's --disable-hybrid-kv-cache-manager; the tests' reference)
    hybrid_kv_cache: bool = True

    @property
    def sized_explicitly(self) -> bool:
        """The user chose the pool's size: one smaller than a max_model_len request is then a warning, not an error."""
        return self.kv_cache_memory is not None or self.num_blocks is not None


DEFAULT_KV_OFFLOAD_DISK_BYTES = 8 * 2**30
DEFAULT_KV_SHARED_TTL_S = 3600.0


@dataclass(frozen=True)
class KVOffloadConfig:
    """The KV tier below the pool (cache/kv_tier.py): prefix blocks the pool evicts kept in host memory, and every
    full prefix block written to a directory that outlives the process. Both off by default."""

    memory_bytes: int = 0  # --kv-offload-memory: the host tier's size (an LRU of evicted blocks); 0: off
    directory: str | None = None  # --kv-offload-dir: the disk tier (None: off)
    disk_bytes: int = DEFAULT_KV_OFFLOAD_DISK_BYTES  # --kv-offload-disk-size: the disk tier's size (oldest use dropped)
    # --kv-shared: a store every replica reads (cache/kv_shared.py): redis://host:port/db, or a directory on a shared
    # filesystem (None: off)
    shared: str | None = None
    shared_ttl_s: float = DEFAULT_KV_SHARED_TTL_S  # --kv-shared-ttl: a Redis block expires this long after its last use
    shared_bytes: int = DEFAULT_KV_OFFLOAD_DISK_BYTES  # --kv-shared-size: a shared directory's size per replica

    @property
    def enabled(self) -> bool:
        return self.memory_bytes > 0 or self.directory is not None or self.shared is not None


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    # a served engine's warm-up lowers the step budget to what this host prefills in about this long
    # (engine/step_budget.py); None: the budget is max_num_batched_tokens (--max-num-batched-tokens given)
    step_seconds: float | None = None


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Bounds on grammar compilation (a schema or regex is user input: it must not stall the server)."""

    compile_timeout_s: float = 5.0  # longer: the request gets a 400 and the compile process is killed
    compile_max_memory_mb: int = 2048  # growth of the compile process beyond its idle size
    cache_size: int = 256  # compiled grammars kept (LRU)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks split each layer; pipeline parallelism: how many ranks split the layers
    among them (both: each stage's layers split across the tensor ranks); and how long a rank may keep the others waiting."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # with pipeline stages: a step's sequences cut into up to this many parts that follow each other through the
    # stages, so the ranks overlap (layers/formats/pipeline.py); 1: each step travels whole; None: `micro_batches_on`
    pipeline_micro_batches: int | None = None

    def micro_batches_on(self, device_type: str) -> int:
        """The parts a step is cut into: as asked, else 2 over gloo (CPU: measured, +23% prefill on 2 cores) and 1
        over NCCL, whose cut steps have not run yet (they need two GPUs: NCCL refuses two ranks on one)."""
        if self.pipeline_micro_batches is not None:
            return self.pipeline_micro_batches
        return 1 if device_type == "cuda" else 2

    @property
    def world_size(self) -> int:
        """Processes in all (rank 0 is the engine's)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
    # A collective (all-reduce) or a rank's start-up that waits longer than this means a hung rank: the step
    # raises and the engine dies (/health 503, exit 1). It also bounds how long a rank waits for the others.
    rank_timeout_s: float = 60.0


LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (`--enable-lora`): adapters known at start, device slots, host cache, largest rank."""

    modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT adapter directory) registered at start
    max_loras: int = 4  # adapters active in one step (device slots)
    max_cpu_loras: int = 16  # adapters kept read in host memory (LRU); more are re-read from disk when used
    max_lora_rank: int = 64  # device slots are sized for this rank; a larger adapter is refused
    # the slots' element type (worker/transforms.lora_slot_dtype): auto, float32, float16, bfloat16
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError("--max-loras and --max-lora-rank must be at least 1")
        if self.dtype not in LORA_DTYPES:
            raise ConfigError(f"--lora-dtype {self.dtype!r}: choose from {', '.join(LORA_DTYPES)}")
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine; derived values are resolved by the engine itself."""

    model: str | None = None  # None: the embedded default model; a path, or a Hugging Face Hub id (org/name)
    revision: str | None = None  # Hub revision (branch, tag or commit) when model is a Hub id
    # a text GGUF's multimodal projector file (llama.cpp's --mmproj): the vision tower and its preprocessing
    mmproj: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # a vision model's tower and projector: auto | float32 | bfloat16 (auto: cpu_dtype.py `encoder_dtype_why`)
    mm_encoder_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda[:N]
    # auto: gguf for a GGUF file with quantized projections on CPU, float32, one rank, else none (loader/gguf_packed.py);
    # none (or None): float weights (transformers parity); int8 | int4: weight-only, applied at load; gguf: the file's blocks
    quantization: str | None = "auto"
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None: torch's default (one per core)
    # CUDA only: decode steps replayed from graphs (worker/cuda_graphs.py). On by default since measured on an H100
    # (benchmarks/results/gpu.json: 5-10x eager decode); --enforce-eager turns them off
    cuda_graphs: bool = True
    enforce_eager: bool = False  # never replay graphs, whatever cuda_graphs says (vLLM's flag)
    # auto | triton | reference: who attends over the paged KV cache (layers/attention/backends.py)
    attention_backend: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv_offload: KVOffloadConfig = field(default_factory=KVOffloadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: "SpeculativeConfig | None" = None
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # serve --chat-template: this Jinja text replaces the model's own chat template (None: the model's), as vLLM's
    # flag does; a reasoning template on a model without one (the tests give SmolLM2 a Qwen3-style "<think>")
    chat_template: str | None = None
    lora: LoraConfig | None = None  # None: LoRA off (no wrappers, no per-step cost)
    pooling: str | None = None  # last | mean | cls for embedding requests; None: the checkpoint's (loader/pooling.py)
    # a decoder served as a reranker (Qwen3-Reranker, vLLM's `classifier_from_token`): the (false, true) tokens whose
    # last-token logits score a pair, softmax over the two; None: the model generates and embeds
    classifier_from_token: tuple[str, str] | None = None


_SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with the keys vLLM users write (`--speculative-config '{...}'`)."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: shortest
    model: str | None = None  # draft_model: a GGUF file or HF directory sharing the target's tokenizer

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(_SPEC_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": the draft model\'s path')

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """Build from parsed JSON, naming any key we do not know (a misspelt key must not pass silently)."""
        if not isinstance(d, dict) or "method" not in d:
            raise ValueError('speculative config must be a JSON object with a "method" ("ngram" or "draft_model")')
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**d)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags of `cli.add_engine_args` (serve, generate, chat and bench share them)."""
    return EngineConfig(
        model=args.model, revision=args.revision, mmproj=getattr(args, "mmproj", None), dtype=args.dtype,
        mm_encoder_dtype=getattr(args, "mm_encoder_dtype", "auto"), device=args.device, quantization=args.quantization,
        max_model_len=args.max_model_len, seed=args.seed,
        num_threads=args.num_threads, speculative=args.speculative_config, cuda_graphs=args.cuda_graphs,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                pipeline_micro_batches=args.pipeline_micro_batches),
        structured=StructuredOutputsConfig(compile_timeout_s=args.grammar_compile_timeout),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          num_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_dtype=args.kv_cache_dtype,
                          hybrid_kv_cache=not args.disable_hybrid_kv_cache_manager),
        kv_offload=KVOffloadConfig(args.kv_offload_memory, args.kv_offload_dir, args.kv_offload_disk_size,
                                   args.kv_shared, args.kv_shared_ttl, args.kv_shared_size),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, enable_chunked_prefill=not args.no_chunked_prefill,
                                  **_step_budget(args.max_num_batched_tokens)),
        lora=lora_config(args), pooling=args.pooling, chat_template=_chat_template(args),
        classifier_from_token=_token_pair(getattr(args, "classifier_from_token", None)),
    )


def _token_pair(value: str | None) -> tuple[str, str] | None:
    """--classifier-from-token's "no,yes" -> ("no", "yes")."""
    if value is None:
        return None
    parts = value.split(",")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--classifier-from-token takes two tokens, false then true (e.g. no,yes), got {value!r}")
    return parts[0], parts[1]


def _chat_template(args: argparse.Namespace) -> str | None:
    """serve's --chat-template: a file's text, else the flag's value taken as the template itself."""
    value = getattr(args, "chat_template_file", None)
    if not value:
        return None
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else value
    except OSError:
        return value


# a step carries what the host prefills in about this long, unless --max-num-batched-tokens says how many tokens
STEP_SECONDS = 1.0


def _step_budget(max_num_batched_tokens: int | None) -> dict:
    """--max-num-batched-tokens as given, or the default budget fitted to the host at warm-up."""
    if max_num_batched_tokens is None:
        return {"step_seconds": STEP_SECONDS}
    return {"max_num_batched_tokens": max_num_batched_tokens}


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """LoraConfig from --enable-lora and its flags (None without --enable-lora)."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        return None
    modules = []
    for item in args.lora_modules or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules takes name=path, got {item!r}")
        modules.append((name, path))
    return LoraConfig(tuple(modules), args.max_loras, args.max_cpu_loras, args.max_lora_rank, args.lora_dtype)


# (flag, value getter, lowest allowed); None values mean "not given" and are not checked.
_AT_LEAST = (
    ("--max-num-seqs", lambda c: c.scheduler.max_num_seqs, 1),
    ("--max-num-batched-tokens", lambda c: c.scheduler.max_num_batched_tokens, 1),
    ("--block-size", lambda c: c.cache.block_size, 1),
    ("--num-kv-blocks", lambda c: c.cache.num_blocks, 1),
    ("--max-model-len", lambda c: c.max_model_len, 1),
    ("--num-threads", lambda c: c.num_threads, 1),
    ("--tensor-parallel-size", lambda c: c.parallel.tensor_parallel_size, 1),
    ("--pipeline-parallel-size", lambda c: c.parallel.pipeline_parallel_size, 1),
    ("--pipeline-micro-batches", lambda c: c.parallel.pipeline_micro_batches, 1),
)


def check_ranges(cfg: EngineConfig) -> None:
    """Numbers that can never work: a zero batch, a negative context, an empty KV cache."""
    for flag, get, low in _AT_LEAST:
        value = get(cfg)
        if value is not None and value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    kv = cfg.cache.kv_cache_memory
    if kv is not None and not kv > 0:  # `not >` also refuses NaN
        raise ConfigError(f"--kv-cache-memory must be > 0 (bytes if > 1, else a fraction of free memory), got {kv}")
    util = cfg.cache.gpu_memory_utilization
    if not 0 < util <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if not cfg.structured.compile_timeout_s > 0:
        raise ConfigError(f"--grammar-compile-timeout must be > 0 seconds, got {cfg.structured.compile_timeout_s}")
