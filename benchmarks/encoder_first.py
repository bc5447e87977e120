"""The CPU gate in one process (worker/cpu_gate.py): one sentence's embedding beside 8 decoding chat streams, with
the gate on and off in alternating rounds, against the same embedding alone.

    python benchmarks/encoder_first.py              # 40 idle, then 6 rounds of 10 per mode
    python benchmarks/encoder_first.py --rounds 1   # checks the script

Two offline engines in one process, as a server holds them: all-MiniLM-L6-v2 (the real model) and the embedded chat
model (SmolLM2-135M Q4_1), 2 threads each. A thread keeps 8 sampled completions decoding; the main thread embeds one
12-word sentence at a time (wall time of `LLM.embed`, and of its engine's execute alone). Modes, each round in turn:
`gate` (the default), `off` (no encoder step holds the gate: the cores are shared as before), `held` (the gate held
throughout with an unbounded allowance: the chat model waits for the whole round, the floor the gate can reach).
No HTTP here: benchmarks/retrieval_mixed.py measures the same through `lmserve serve`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from compare import _cpu_name  # noqa: E402

import lmserve  # noqa: E402,F401  before torch: lmserve sets the OpenMP wait policy every command runs with
from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.layers.kernels.native import native_module  # noqa: E402
from lmserve.loader import default_model_path  # noqa: E402
from lmserve.worker import cpu_gate  # noqa: E402
from tests.encoder_models import minilm_dir  # noqa: E402

SENTENCE = "Retrieval augmented generation needs a fast embedder next to the chat model."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=10)
    args = ap.parse_args()
    mod = native_module()
    if mod is None:
        sys.exit("needs the native CPU kernels")
    chat, emb = LLM(str(default_model_path()), num_threads=2), LLM(str(minilm_dir()), num_threads=2)
    forward: list[float] = []
    execute = emb.engine.executor.execute

    def timed(out):
        t = time.perf_counter()
        result = execute(out)
        forward.append((time.perf_counter() - t) * 1000)
        return result

    emb.engine.executor.execute = timed

    def embed(n: int) -> tuple[list[float], list[float]]:
        walls = []
        forward.clear()
        for _ in range(n):
            t = time.perf_counter()
            emb.embed([SENTENCE], use_tqdm=False)
            walls.append((time.perf_counter() - t) * 1000)
        return walls, forward[:]

    embed(5)
    load_before = os.getloadavg()[0]
    walls: dict[str, list[float]] = {m: [] for m in ("idle", "gate", "off", "held")}
    fwds: dict[str, list[float]] = {m: [] for m in walls}
    w, f = embed(4 * args.per_round)
    walls["idle"] += w
    fwds["idle"] += f
    stop = threading.Event()
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.8)

    def decode() -> None:
        while not stop.is_set():
            chat.generate([f"Story {i}: once upon a time" for i in range(8)], params, use_tqdm=False)

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    time.sleep(3)
    urgent, allowance = cpu_gate.URGENT_TOKENS, cpu_gate.PAUSE_PER_STEP_MS
    stats0 = cpu_gate.gate_stats()
    for _ in range(args.rounds):
        for mode in ("gate", "off", "held"):
            cpu_gate.URGENT_TOKENS = urgent if mode != "off" else -1
            if mode == "held":
                cpu_gate.PAUSE_PER_STEP_MS = 10**6
                mod.gate_hold()
                time.sleep(0.3)  # the chat model reaches its next layer
            try:
                w, f = embed(args.per_round)
            finally:
                if mode == "held":
                    mod.gate_release()
                    cpu_gate.PAUSE_PER_STEP_MS = allowance
            walls[mode] += w
            fwds[mode] += f
    cpu_gate.URGENT_TOKENS = urgent
    stats1 = cpu_gate.gate_stats()
    stop.set()
    thread.join()
    print(f"CPU: {_cpu_name()} ({len(os.sched_getaffinity(0))} cores), load average (1 min) {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print("| mode | embed p50 / p90 ms | its engine's execute p50 ms | n |")
    print("|---|---|---|---|")
    for mode, ms in walls.items():
        q = statistics.quantiles(ms, n=10)
        label = {"idle": "alone", "gate": "8 streams, gate on (default)", "off": "8 streams, gate off",
                 "held": "8 streams, chat held throughout"}[mode]
        print(f"| {label} | {statistics.median(ms):.1f} / {q[-1]:.1f} | {statistics.median(fwds[mode]):.1f} | {len(ms)} |")
    print("gate counters over the rounds:", {k: stats1[k] - stats0[k] for k in stats1})


if __name__ == "__main__":
    main()
