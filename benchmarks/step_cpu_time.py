"""Median wall and CPU milliseconds of one decode step, batch 1 and 8, on the embedded model (2 threads).

CPU time (this process, every thread) is what a step costs; on a shared machine the wall time also holds
the waits for a free core, which swing by several times between runs. Comparing two trees on a busy host,
run it alternately under each (results/structure_speed.md):

    PYTHONPATH=<tree>/src python benchmarks/step_cpu_time.py

The prompts are 32 tokens, 48 tokens are generated (EOS ignored), greedy; each batch size runs three times
and the first run (its shapes' one-time costs) is left out. Prints one JSON line: {batch: {"wall", "cpu"}}.
"""

from __future__ import annotations

import json
import statistics
import time

from lmserve.config import EngineConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams


def main() -> None:
    eng = LLMEngine(EngineConfig(num_threads=2))
    out: dict[int, dict[str, list[float]]] = {}
    for batch in (1, 8):
        for it in range(3):
            for i in range(batch):
                eng.add_request(f"b{batch}-{it}-{i}", [(7 * i + j + it) % 5000 + 10 for j in range(32)],
                                SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
            walls, cpus = [], []
            eng.step()  # the prefill
            while eng.has_unfinished():
                wall, cpu = time.perf_counter(), time.process_time()
                eng.step()
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            if it:
                d = out.setdefault(batch, {"wall": [], "cpu": []})
                d["wall"] += walls
                d["cpu"] += cpus
    print(json.dumps({b: {k: round(statistics.median(v) * 1000, 2) for k, v in d.items()} for b, d in out.items()}))


if __name__ == "__main__":
    main()
