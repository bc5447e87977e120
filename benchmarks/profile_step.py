"""Where a decode step's time goes: batch 1 and batch 32, the embedded GGUF kept quantized; and a prefill.

    python benchmarks/profile_step.py [--batches 1,32] [--tokens 48] [--prefill 512] [--out benchmarks/results/profile_step.md]

Two passes per batch size in one process: with the native decode stack (the default: all decoder layers in one
C++ call) for the step's wall time split into decoder layers / LM head / the rest, and with the stack off
(LMSERVE_DECODE_STACK=0 path: the module loop) under cProfile for the per-kernel split inside the layers. The CPU,
its flags and the load average are recorded: numbers from another machine, or a busy one, mean little.
`--prefill N` adds a prompt of N tokens run alone (one step while N <= the engine's 1024 batched tokens): its
wall time over 3 runs, and its split under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch  # noqa: E402
from gguf_decode import cpu  # noqa: E402

from lmserve.config import CacheConfig, EngineConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.layers.kernels.decode_stack import NativeDecodeLoop, apply_decode_stack, remove_decode_stack  # noqa: E402
from lmserve.layers.kernels.native import native_module  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


def start(engine: LLMEngine, batch: int, tokens: int) -> None:
    """Admit `batch` greedy requests and run until every one is decoding."""
    for i in range(batch):
        engine.add_request(f"{time.time_ns()}-{i}", PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                          ignore_eos=True))
    for _ in range(4):
        engine.step()


class PhaseClock:
    """Seconds inside the decode stack's call and the LM head, wrapped around one engine's model until restore()."""

    def __init__(self, engine: LLMEngine) -> None:
        self.model = model = engine.loaded.model
        self.seconds = {"decoder layers (native stack)": 0.0, "LM head": 0.0}
        # None: the stack does not apply to this model; its layers are not timed apart
        self.loop = model.layer_loop if isinstance(model.layer_loop, NativeDecodeLoop) else None
        if self.loop is not None:
            self.saved = self.loop.stack
            self.loop.stack = self._timed(self.saved, "decoder layers (native stack)")
        model.compute_logits = self._timed(model.compute_logits, "LM head")  # an instance attribute over the method

    def _timed(self, fn, name: str):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
        return call

    def restore(self) -> None:
        if self.loop is not None:
            self.loop.stack = self.saved
        del self.model.compute_logits


def timed_steps(engine: LLMEngine) -> tuple[list[float], dict[str, float], dict[str, float]]:
    """Wall seconds of each remaining step, the mean seconds per step in the decoder layers and the LM head, and the
    native worker pool's counters per step (thread_pool.h)."""
    mod = native_module()
    clock = PhaseClock(engine)
    before, times = mod.pool_stats(), []
    try:
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    finally:
        clock.restore()
    after = mod.pool_stats()
    phases = {k: v / len(times) for k, v in clock.seconds.items()}
    return times, phases, {k: (after[k] - before[k]) / len(times) for k in after}


def profiled_steps(engine: LLMEngine) -> tuple[int, dict[str, float], float]:
    """(steps, seconds per native function, total seconds) of the remaining steps under cProfile."""
    prof = cProfile.Profile()
    steps, t = 0, time.perf_counter()
    prof.enable()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    prof.disable()
    total = time.perf_counter() - t
    return steps, native_split(prof), total


def prefill_tokens(n: int, run: int) -> list[int]:
    """n prompt tokens that no earlier run shares a prefix with (a prefix-cache hit would skip the work)."""
    return [1 + (run * 7919 + i * 31) % 40000 for i in range(n)]


def prefill_runs(engine: LLMEngine, n: int, runs: int, first: int) -> list[float]:
    times = []
    for r in range(first, first + runs):
        engine.add_request(f"prefill-{r}", prefill_tokens(n, r), SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return times


def prefill_section(engine: LLMEngine, n: int) -> list[str]:
    prefill_runs(engine, n, 1, 0)  # warm-up
    wall = statistics.median(prefill_runs(engine, n, 3, 1))
    prof = cProfile.Profile()
    prof.enable()
    total = sum(prefill_runs(engine, n, 1, 4))
    prof.disable()
    per = native_split(prof)
    lines = [f"## prefill of {n} tokens", "", f"median wall: {wall * 1000:.1f} ms ({n / wall:.0f} tokens/s)", "",
             f"under cProfile ({total * 1000:.1f} ms incl. profiler):", "", "| native function | ms | share |",
             "|---|---|---|"]
    for name, sec in sorted(per.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {sec * 1000:.1f} | {sec / total:.0%} |")
    rest = total - sum(per.values())
    return lines + [f"| everything else (torch ops, Python) | {rest * 1000:.1f} | {rest / total:.0%} |", ""]


def native_split(prof: cProfile.Profile) -> dict[str, float]:
    """Seconds in each C++ kernel (built-ins: their own time is all their time). The extension is named for its
    build (`_native_avx512_vnni`, `_native_avx2`, ...: layers/kernels/native.py), so its name is read, not assumed."""
    prefix = native_module().__name__ + "."
    per = {}
    for (_, _, name), row in pstats.Stats(prof).stats.items():
        if prefix in name:
            label = name.strip("<>").split(prefix)[1]
            per[label] = per.get(label, 0.0) + row[2]
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=0, help="also profile a prompt of this many tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(quantization="gguf", cache=CacheConfig(num_blocks=512)))
    model = engine.loaded.model
    policy = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    lines = [f"# Decode step profile ({cpu()['name']}, {cpu()['cores']} cores, flags {' '.join(cpu()['flags'])}, "
             f"load {os.getloadavg()[0]:.1f}; {torch.get_num_threads()} threads, thread policy {policy or 'libgomp default'})",
             ""]
    for batch in (int(b) for b in args.batches.split(",") if b):
        apply_decode_stack(model)
        start(engine, batch, args.tokens)
        times, phases, pool = timed_steps(engine)
        wall = statistics.median(times) * 1000
        mean = sum(times) / len(times)
        remove_decode_stack(model)
        start(engine, batch, args.tokens)
        steps, per, total = profiled_steps(engine)
        lines += [f"## batch {batch}", "", f"median decode step with the native stack: {wall:.2f} ms", "",
                  "| phase (native stack on) | ms per step (mean) | share |", "|---|---|---|",
                  *[f"| {k} | {v * 1000:.2f} | {v / mean:.0%} |" for k, v in phases.items()],
                  f"| everything else (embedding, sampler, scheduler, Python) | {(mean - sum(phases.values())) * 1000:.2f} "
                  f"| {(mean - sum(phases.values())) / mean:.0%} |", "",
                  f"per step, the kernels' worker pool ran {pool['jobs']:.0f} jobs on its threads and "
                  f"{pool['inline_jobs']:.0f} on the caller alone; it woke parked workers {pool['wakeups']:.2f} times, "
                  f"the caller parked {pool['caller_parks']:.2f} times ({pool['stalls']:.2f} stalls, "
                  f"{pool['backoffs']:.2f} back-offs)", "",
                  f"module loop under cProfile ({steps} steps, {total / steps * 1000:.2f} ms a step incl. profiler):",
                  "", "| native function | ms per step | share |", "|---|---|---|"]
        # quant_linear includes the LM head (one call a step) besides the 4 projections of every layer
        for name, sec in sorted(per.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {name} | {sec / steps * 1000:.2f} | {sec / total:.0%} |")
        rest = total - sum(per.values())
        lines += [f"| everything else (Python, sampler, scheduler) | {rest / steps * 1000:.2f} | {rest / total:.0%} |",
                  ""]
    if args.prefill:
        apply_decode_stack(model)
        lines += prefill_section(engine, args.prefill)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
