"""`lmserve run-batch` vs `lmserve bench throughput` on the same prompts: output tokens/s of each.

    python benchmarks/batch_throughput.py [--num-prompts 32] [--input-len 128] [--output-len 64] [--max-num-seqs 16]
        [--rounds 3] [--num-threads 2] [--output benchmarks/results/batch_throughput]

Both run the embedded model with the same engine flags, in rounds whose order flips (bench then batch, batch then
bench, ...) so a neighbour's load lands on both alike. The batch file holds exactly bench throughput's prompts (its
token ids, from lmserve.bench.offline), greedy, `ignore_eos`, `max_tokens` = the output length, through
/v1/completions. Each side's tokens/s is its own measurement from its first request to its last token
(model load and warm-up excluded on both; bench throughput's warm-up also runs its batch's shapes once, run-batch's
only one tiny request, so run-batch's clock includes the first-use cost of each batch shape). Writes <output>.json
and <output>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from lmserve.bench.offline import _prompt  # noqa: E402  (bench throughput's own prompts)

MODEL = "SmolLM2-135M-Instruct"


def lmserve(*args: str) -> None:
    """Run a command; its progress bars are dropped (its stderr is shown only if it fails)."""
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "--log-level", "warning", *args],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"lmserve {' '.join(args[:2])} exited {p.returncode}:\n{p.stderr[-3000:]}")


def engine_flags(a: argparse.Namespace) -> list[str]:
    return ["--max-num-seqs", str(a.max_num_seqs), "--num-threads", str(a.num_threads),
            "--kv-cache-memory", str(a.kv_cache_mib * 2**20)]


def bench_once(a: argparse.Namespace, tmp: Path) -> float:
    out = tmp / "bench.json"
    lmserve("bench", "throughput", "--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len),
            "--output-len", str(a.output_len), "--output", str(out), *engine_flags(a))
    return json.loads(out.read_text())["runs"][0]["output_tok_s"]


def batch_input(a: argparse.Namespace, path: Path) -> None:
    """bench throughput's timed prompts (seeds 1_000_000 + i) as /v1/completions lines."""
    with open(path, "w") as f:
        for i in range(a.num_prompts):
            body = {"model": MODEL, "prompt": _prompt(a.input_len, 1_000_000 + i), "max_tokens": a.output_len,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def batch_once(a: argparse.Namespace, tmp: Path, src: Path, n: int) -> float:
    out, summary = tmp / f"results{n}.jsonl", tmp / f"summary{n}.json"
    lmserve("run-batch", "-i", str(src), "-o", str(out), "--summary", str(summary), *engine_flags(a))
    s = json.loads(summary.read_text())
    assert s["completed"] == a.num_prompts and s["completion_tokens"] == a.num_prompts * a.output_len, s
    return s["output_tok_s"]


def machine() -> dict:
    import torch

    info = open("/proc/cpuinfo").read().splitlines()
    field = lambda name: next((x.split(":", 1)[1].strip() for x in info if x.startswith(name)), "")  # noqa: E731
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in field("flags").split()]
    return {"cpu": field("model name") or platform.processor(), "cpu_flags": flags,
            "cores_usable": len(os.sched_getaffinity(0)), "python": platform.python_version(), "torch": torch.__version__}


def to_markdown(r: dict) -> str:
    m, a = r["machine"], r["args"]
    rows = "\n".join(f"| {i + 1} | {b:.1f} | {c:.1f} | {c / b:.2f} |"
                     for i, (b, c) in enumerate(zip(r["bench_tok_s"], r["batch_tok_s"])))
    return (f"# run-batch vs bench throughput (same prompts)\n\n"
            f"{m['cpu']} ({', '.join(m.get('cpu_flags', [])) or 'no AVX2'}), {m['cores_usable']} cores usable, "
            f"torch {m['torch']}. Flags: `{' '.join(r['flags'])}`; "
            f"{a['num_prompts']} prompts of {a['input_len']} tokens, {a['output_len']} output tokens each "
            f"(greedy, ignore_eos). Load average (1 min) {r['loadavg_start']:.2f} before, {r['loadavg_end']:.2f} "
            f"after (other processes shared the cores: the rounds spread with it); the run took {r['wall_s']:.0f} s. "
            f"Each side's tok/s runs from its first request to its last token; round order flips each round.\n\n"
            f"| round | bench throughput (output tok/s) | run-batch (output tok/s) | batch / bench |\n"
            f"| --- | --- | --- | --- |\n{rows}\n"
            f"| median | {statistics.median(r['bench_tok_s']):.1f} | {statistics.median(r['batch_tok_s']):.1f} | "
            f"{r['ratio']:.2f} |\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "batch_throughput"),
                    help="writes OUTPUT.json and OUTPUT.md")
    a = ap.parse_args()
    start, load0 = time.time(), os.getloadavg()[0]
    bench, batch = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = tmp / "requests.jsonl"
        batch_input(a, src)
        for n in range(a.rounds):  # the order flips every round, so a drifting neighbour favours neither
            if n % 2:
                batch.append(batch_once(a, tmp, src, n))
                bench.append(bench_once(a, tmp))
            else:
                bench.append(bench_once(a, tmp))
                batch.append(batch_once(a, tmp, src, n))
            print(f"round {n + 1}: bench {bench[-1]:.1f} tok/s, run-batch {batch[-1]:.1f} tok/s", file=sys.stderr)
    result = {"machine": machine(), "args": vars(a), "flags": engine_flags(a), "bench_tok_s": bench,
              "batch_tok_s": batch, "ratio": statistics.median(batch) / statistics.median(bench),
              "loadavg_start": load0, "loadavg_end": os.getloadavg()[0], "wall_s": time.time() - start}
    Path(a.output + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(a.output + ".md").write_text(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
