"""What `--dtype auto` means (bf16 on CUDA; on a CPU bfloat16 only with AMX, where a measurement says it pays and
keeps batch invariance), and --dtype names resolved to torch dtypes.

bf16 gives up the native float32 kernels (paged attention, fused ops, the decode stack), so its matmuls must win
by much. Without AMX they never did end to end: with AVX512_BF16 alone a Zen 4 host served 16-32 streams at 1.0x
llama.cpp in bf16 against 1.7-1.9x in float32, a Xeon measured bf16 matmuls at 0.65x float32's, and a Zen 5 host,
whose bf16 matmuls alone ran 4.4x float32's on the prefill shape and 1.5x on the decode shape, served 0.54x
float32's offline throughput in bf16 (`lmserve bench throughput --quantization none`, 183 vs 338 tok/s) and
prefilled at 0.62x. So only AMX (Sapphire Rapids and later, tile matmuls several times float32's) is measured:
the first `auto` there times a prefill-shaped and a decode-shaped matmul in both dtypes and checks that a bf16 row
is the same bits alone and inside batches of several sizes. bf16 is chosen only when it is invariant and clearly
faster; the decision and its numbers are cached per CPU flags and torch version beside the native kernels
(~/.cache/lmserve/kernels), so it is measured once a machine.

A vision tower is another matter (`--mm-encoder-dtype`, `encoder_dtype_why`): dense matmuls over an image's patches
(SmolVLM's SigLIP: 1024 rows a 512 px view), no paged attention, no decode stack, no native float32 kernel given up,
so bf16 keeps all of its matmul speed-up (a SigLIP view of SmolVLM-256M's shape, 2 threads, Zen 5: 1.28 s float32,
0.51 s bf16 in transformers). `auto` is bf16 on CUDA; on a CPU with AVX512_BF16 or AMX it is bf16 when a
tower-shaped matmul, timed once a machine and cached like the text decision, runs at least MIN_ENCODER_SPEEDUP x
float32's; float32 elsewhere (bf16 emulated on AVX2 is slower). Batch invariance is not asked of it: the runner
encodes each image alone (worker/mm_encoder.py), so an image's embeddings never depend on other requests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

from lmserve.files import write_atomically
from lmserve.utils import DTYPES, cpu_flags, cpu_has_fast_bf16

log = logging.getLogger(__name__)

# On an AMX CPU bf16's matmuls must still win by much (the module docstring): tiles are expected at 3x and more. And
# bf16 must not lose on single rows (decode).
MIN_PREFILL_SPEEDUP = 2.0
MIN_DECODE_SPEEDUP = 1.0
PREFILL, DECODE = (256, 1024, 1024), (1, 1024, 4096)  # (rows, in, out): a prefill chunk's and a decode step's matmul
INVARIANCE_ROWS = (1, 3, 16, 64, 256)
# --mm-encoder-dtype auto: one 512 px view through a SigLIP MLP's fc1 (SmolVLM-256M: 1024 patches, 768 -> 3072)
ENCODER_SHAPE = (1024, 768, 3072)
MIN_ENCODER_SPEEDUP = 1.5
ENCODER_DTYPES = ("auto", "float32", "bfloat16")


def auto_dtype(device: torch.device, flags: str | None = None, kept_gguf: bool = False) -> torch.dtype:
    """What `--dtype auto` means: bf16 on CUDA; on a CPU float32 unless a measurement made once on this machine
    found bf16 clearly faster and batch invariant (measured_cpu_dtype, below). `kept_gguf`: the weights stay in a GGUF file's
    blocks, whose int8 kernels take float32 activations. `flags` is a cpuinfo flags line (default: this machine's).
    """
    return auto_dtype_why(device, flags, kept_gguf)[0]


def auto_dtype_why(device: torch.device, flags: str | None = None, kept_gguf: bool = False) -> tuple[torch.dtype, str]:
    """auto_dtype's answer and its reason (for the start-up log)."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    if kept_gguf:
        return torch.float32, "the GGUF blocks are kept: their int8 kernels take float32 activations"
    return measured_cpu_dtype(cpu_flags() if flags is None else flags)


def resolve_dtype(name: str, device: torch.device, kept_gguf: bool = False) -> torch.dtype:
    """A --dtype name -> torch dtype; 'auto' as auto_dtype decides."""
    if name == "auto":
        return auto_dtype(device, kept_gguf=kept_gguf)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from auto, float32, bfloat16, float16)")
    return DTYPES[name]


def cache_file(flags: str, kind: str = "dtype") -> Path:
    """Where a decision measured on this CPU (its flags) with this torch is kept: kind `dtype` (--dtype),
    `mm-encoder-dtype` (--mm-encoder-dtype)."""
    root = Path(os.environ.get("LMSERVE_CACHE_DIR", Path.home() / ".cache" / "lmserve")) / "kernels"
    key = hashlib.sha256(f"{flags.strip()}|{torch.__version__}".encode()).hexdigest()[:16]
    return root / f"{kind}-{key}.json"


def _best_time(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _matmul_seconds(shape: tuple[int, int, int], dtype: torch.dtype) -> float:
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    return _best_time(lambda: torch.nn.functional.linear(x, w))


def bf16_batch_invariant() -> bool:
    """Is each bf16 row the same bits alone and inside every batch size of INVARIANCE_ROWS?"""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(INVARIANCE_ROWS), PREFILL[1], generator=g).bfloat16()
    w = torch.randn(PREFILL[2], PREFILL[1], generator=g).bfloat16()
    alone = torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(4)])
    return all(torch.equal(torch.nn.functional.linear(x[:m], w)[:min(m, 4)], alone[:min(m, 4)])
               for m in INVARIANCE_ROWS)


def measure() -> dict:
    """Seconds per matmul in each dtype for both shapes (on one thread: a busy neighbour then skews both dtypes
    alike; measured on 2 threads of a loaded host, float32 lost 2x more than bf16), and bf16's batch invariance."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"prefill_f32": _matmul_seconds(PREFILL, torch.float32),
                "prefill_bf16": _matmul_seconds(PREFILL, torch.bfloat16),
                "decode_f32": _matmul_seconds(DECODE, torch.float32),
                "decode_bf16": _matmul_seconds(DECODE, torch.bfloat16),
                "bf16_batch_invariant": bf16_batch_invariant()}
    finally:
        torch.set_num_threads(threads)


def decide(m: dict) -> tuple[str, str]:
    """(dtype name, why) from measure()'s numbers."""
    prefill = m["prefill_f32"] / m["prefill_bf16"]
    decode = m["decode_f32"] / m["decode_bf16"]
    speed = f"bf16 prefill matmul {prefill:.2f}x float32's, decode {decode:.2f}x"
    if not m["bf16_batch_invariant"]:
        return "float32", f"bf16 matmuls depend on the batch here ({speed})"
    if prefill < MIN_PREFILL_SPEEDUP or decode < MIN_DECODE_SPEEDUP:
        return "float32", f"{speed}; bf16 needs >= {MIN_PREFILL_SPEEDUP}x and >= {MIN_DECODE_SPEEDUP}x"
    return "bfloat16", f"{speed}, batch invariant"


def measured_cpu_dtype(flags: str) -> tuple[torch.dtype, str]:
    """This CPU's auto dtype and why: float32 without AMX; with it cached, else measured now (about a second) and
    cached."""
    if not cpu_has_fast_bf16(flags):
        return torch.float32, "no bf16 instructions"
    if "amx_bf16" not in flags.split():
        return torch.float32, "no AMX: bf16 without tiles lost end to end on every CPU measured (cpu_dtype.py)"
    return _cached_decision(cache_file(flags), measure, decide)


def _cached_decision(path: Path, measure_fn: Callable[[], dict],
                     decide_fn: Callable[[dict], tuple[str, str]]) -> tuple[torch.dtype, str]:
    """A decision (dtype name, why) read from `path`, else measured and decided now and written there."""
    try:
        record = json.loads(path.read_text())
        name, why = record["dtype"], record["why"]
    except (OSError, ValueError, KeyError):
        m = measure_fn()
        name, why = decide_fn(m)
        try:
            # a reader never sees half a file, and two processes measuring at once both succeed
            record = {"dtype": name, "why": why, "measured": m, "torch": torch.__version__}
            write_atomically(path, json.dumps(record, indent=1).encode())
        except OSError as e:  # a read-only home: measure again next start
            log.warning("could not cache the dtype measurement in %s: %s", path, e)
    if name not in ("float32", "bfloat16"):
        return torch.float32, f"unreadable cache {path}"
    return getattr(torch, name), why


def encoder_dtype_why(name: str, device: torch.device, flags: str | None = None) -> tuple[torch.dtype, str]:
    """A --mm-encoder-dtype name -> (the vision tower's dtype, why): `auto` is bf16 on CUDA; on a CPU bf16 where
    it has bf16 instructions and a tower-shaped matmul measured once on it is >= MIN_ENCODER_SPEEDUP x float32's;
    float32 otherwise. `flags`: a cpuinfo flags line (default: this machine's)."""
    if name not in ENCODER_DTYPES:
        raise ValueError(f"unknown --mm-encoder-dtype {name!r} (choose from {', '.join(ENCODER_DTYPES)})")
    if name != "auto":
        return DTYPES[name], "asked for"
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = cpu_flags() if flags is None else flags
    if not cpu_has_fast_bf16(flags):
        return torch.float32, "no bf16 instructions (AVX512_BF16 or AMX)"
    return _cached_decision(cache_file(flags, "mm-encoder-dtype"), measure_encoder, decide_encoder)


def _packed_matmul(shape: tuple[int, int, int], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One matmul as a CPU tower runs its linears: oneDNN's packed weights (layers/formats/linear.py), where this
    torch has them; else torch's own."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_reorder_linear_weight"):
        return lambda: torch.nn.functional.linear(x, w)
    packed = mkldnn._reorder_linear_weight(w)
    return lambda: mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def measure_encoder(reps: int = 7) -> dict:
    """Seconds of ENCODER_SHAPE's matmul in each dtype, the best of `reps` taken in turns (f32, bf16, f32, ...) on
    one thread, so a neighbour busy for part of the measurement slows both dtypes' worst runs, not one dtype."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fns = {"f32": _packed_matmul(ENCODER_SHAPE, torch.float32), "bf16": _packed_matmul(ENCODER_SHAPE, torch.bfloat16)}
        best = {name: float("inf") for name in fns}
        for name, fn in fns.items():  # warm-up: oneDNN builds its kernels
            fn()
        for _ in range(reps):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        return best
    finally:
        torch.set_num_threads(threads)


def decide_encoder(m: dict) -> tuple[str, str]:
    """(dtype name, why) from measure_encoder()'s numbers."""
    speedup = m["f32"] / m["bf16"]
    if speedup < MIN_ENCODER_SPEEDUP:
        return "float32", f"a bf16 tower matmul ran {speedup:.2f}x float32's here; bf16 needs >= {MIN_ENCODER_SPEEDUP}x"
    return "bfloat16", f"a bf16 tower matmul ran {speedup:.2f}x float32's here"
