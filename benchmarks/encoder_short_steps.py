"""An encoder's short steps off OpenMP: one sentence's embedding with the encoder's kernels as they ship, against
oneDNN's linears and ATen's LayerNorm (each opens an OpenMP region whose sleeping thread must be woken), in one
process, modes alternating in rounds.

    python benchmarks/encoder_short_steps.py              # 5 rounds of 8 a cell
    python benchmarks/encoder_short_steps.py --rounds 1   # checks the script

all-MiniLM-L6-v2 (the real model), one offline engine, 2 threads. Cells: mode x gap x input. Modes:
  default   as shipped: LayerNorm one native call (layers/blocks/norm.py), linears on the skinny kernel for steps of
            up to ENCODER_SKINNY_ROWS tokens where the CPU has no AVX-512 (layers/formats/linear.py)
  onednn    the linears on oneDNN past 8 rows (SKINNY_MAX_ROWS, as before), LayerNorm native
  aten      oneDNN past 8 rows and ATen's LayerNorm: the encoder before this change
Gaps: 0 (back to back) and 100 ms after the last answer (an idle server's next query). Inputs: a 12-word sentence
(18 tokens) and the same four times (62 tokens). Wall time of `LLM.embed`, p50 per cell.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from compare import _cpu_name  # noqa: E402

import lmserve  # noqa: E402,F401  before torch: the OpenMP wait policy every command runs with
from lmserve import LLM  # noqa: E402
from lmserve.layers.blocks.norm import LayerNorm  # noqa: E402
from lmserve.layers.formats.linear import SKINNY_MAX_ROWS, PackedLinear  # noqa: E402
from tests.encoder_models import minilm_dir  # noqa: E402

SENTENCE = "Retrieval augmented generation needs a fast embedder next to the chat model."
INPUTS = {"18 tokens": SENTENCE, "62 tokens": " ".join([SENTENCE] * 4)}
GAPS_MS = (0, 100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-cell", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(str(minilm_dir()), num_threads=2)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.panels is not None]
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    shipped = {m.skinny_rows for m in linears}
    as_shipped = max(shipped, default=SKINNY_MAX_ROWS)  # one limit for every layer (widen_skinny_steps)

    def mode(name: str) -> None:
        for m in linears:
            m.skinny_rows = as_shipped if name == "default" else SKINNY_MAX_ROWS
        for m in norms:  # ATen's: nn.LayerNorm's own forward on the same parameters
            if name == "aten":
                m.forward = super(LayerNorm, m).forward
            else:
                m.__dict__.pop("forward", None)

    modes = ("default", "onednn", "aten")
    cells: dict[tuple[str, int, str], list[float]] = {(m, g, i): [] for m in modes for g in GAPS_MS for i in INPUTS}
    for m in modes:  # warm every path
        mode(m)
        for text in INPUTS.values():
            llm.embed([text], use_tqdm=False)
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for m in modes:
            mode(m)
            for gap in GAPS_MS:
                for name, text in INPUTS.items():
                    for _ in range(args.per_cell):
                        time.sleep(gap / 1000)
                        t = time.perf_counter()
                        llm.embed([text], use_tqdm=False)
                        cells[(m, gap, name)].append((time.perf_counter() - t) * 1000)
    print(f"CPU: {_cpu_name()}; load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"skinny rows as shipped: {sorted(shipped)} ({len(linears)} layers); {args.rounds} rounds of {args.per_cell}")
    print("| input | gap | default p50 ms | oneDNN past 8 rows | + ATen LayerNorm (before) |")
    print("|---|---|---|---|---|")
    for name in INPUTS:
        for gap in GAPS_MS:
            row = [statistics.median(cells[(m, gap, name)]) for m in modes]
            print(f"| {name} | {gap} ms | " + " | ".join(f"{v:.1f}" for v in row) + " |")


if __name__ == "__main__":
    main()
