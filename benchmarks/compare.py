"""lmserve vs llama.cpp's llama-server vs Hugging Face transformers, side by side in one run.

    python benchmarks/compare.py            (or: bash benchmarks/compare)
    python benchmarks/compare.py --lmserve-args "--quantization int4" --levels 1,4,16 --rates "" \
        --out benchmarks/results/compare_int4.json     (lmserve on weight-only int4 weights)

Same machine, same model file (the embedded SmolLM2 GGUF), same prompts (256 tokens in, exactly
128 out, greedy, streamed), same 2 threads. Runs alternate lmserve, llama.cpp, transformers at every
level after a discarded warm-up; medians are reported with min-max. transformers has no server: it
runs offline `generate` with static batches of the same size (said so in the tables). llama-server
is built from the llama.cpp sources in PyPI's llama-cpp-python sdist (benchmarks/build_llama_server.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from lmserve.bench import serve as sb  # noqa: E402
from lmserve.loader import default_model_path  # noqa: E402

INPUT_LEN, OUTPUT_LEN, THREADS = 256, 128, 2
VOCAB = 49152


class Proc:
    """A server process with its load time and sampled peak RSS."""

    def __init__(self, name: str, cmd: list[str], url: str, env: dict | None = None) -> None:
        self.name, self.url = name, url
        start = time.perf_counter()
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**os.environ, **(env or {})})
        self.peak_rss = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()
        while time.perf_counter() - start < 300:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.p.poll() is not None:
                raise RuntimeError(f"{name} exited during start")
            time.sleep(0.2)
        self.load_s = time.perf_counter() - start

    def _sample(self) -> None:
        proc = psutil.Process(self.p.pid)
        while not self._stop.is_set() and self.p.poll() is None:
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                self.peak_rss = max(self.peak_rss, rss)
            except psutil.Error:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self.p.terminate()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()


def start_lmserve(port: int, extra: list[str]) -> Proc:
    cmd = [sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port), "--num-threads", str(THREADS),
           "--max-num-seqs", "32", "--log-level", "warning", "--kv-cache-memory", str(2 * 2**30), *extra]
    return Proc("lmserve", cmd, f"http://127.0.0.1:{port}", env={"PYTHONPATH": str(ROOT.parent / "src")})


def start_llama(port: int, binary: str, slots: int) -> Proc:
    ctx = slots * (INPUT_LEN + OUTPUT_LEN + 64)
    cmd = [binary, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
           "-tb", str(THREADS), "-np", str(slots), "-c", str(ctx), "--cont-batching", "--no-webui"]
    return Proc("llama.cpp", cmd, f"http://127.0.0.1:{port}")


def requests_for(n: int, seed: int) -> list[sb.BenchRequest]:
    return sb.random_dataset(n, INPUT_LEN, OUTPUT_LEN, 0.0, VOCAB, seed)


def run_server(proc: Proc, model: str, reqs, concurrency: int | None, rate: float | None, slos: dict) -> dict:
    cpu = time.process_time()
    results, wall = asyncio.run(sb.run_load(proc.url, model, "completions", reqs, concurrency, rate, None, True, 0,
                                            progress=False))
    out = sb.summarize(results, wall, slos, time.process_time() - cpu)
    out["texts"] = [r.text for r in results[:4]]
    return out


def run_hf(model, reqs, batch: int) -> dict:
    """transformers offline: static batches of `batch`; TTFT = time of a 1-token generate of the batch."""
    import torch

    ids = [r.prompt for r in reqs]
    start = time.perf_counter()
    ttfts, tpots, texts = [], [], []
    for i in range(0, len(ids), batch):
        x = torch.tensor(ids[i:i + batch])
        kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, **kw)
            t2 = time.perf_counter()
        ttfts += [t1 - t0] * x.shape[0]
        tpots += [((t2 - t1) - (t1 - t0)) / (OUTPUT_LEN - 1)] * x.shape[0]
        texts += out[:, x.shape[1]:].tolist()
    wall = time.perf_counter() - start
    ms = lambda xs: {"median": statistics.median(xs) * 1e3}  # noqa: E731
    return {"completed": len(ids), "failed": 0, "duration_s": wall, "output_throughput": len(ids) * OUTPUT_LEN / wall,
            "ttft_ms": ms(ttfts), "tpot_ms": ms(tpots), "itl_ms": ms(tpots), "e2el_ms": ms([wall / max(1, len(ids) // batch)]),
            "token_ids": texts[:4]}


def first_tokens_match(a: list[int], b: list[int], n: int = 32) -> bool:
    return a[:n] == b[:n]


def median_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rates", default="0.25,0.5,1.0", help="request rates (req/s) for the goodput sweep ('' skips it)")
    ap.add_argument("--lmserve-args", default="", help="extra `lmserve serve` flags, e.g. '--quantization int4'")
    ap.add_argument("--goodput", default="ttft:3000 tpot:250")
    ap.add_argument("--out", default=str(ROOT / "results" / "compare.json"))
    ap.add_argument("--render", default=None, help="only re-render the tables of a saved result JSON")
    args = ap.parse_args()
    if args.render:
        report = json.loads(Path(args.render).read_text())
        levels = [int(x) for x in report["config"]["levels"].split(",")]
        table = render_tables(report, levels)
        Path(args.render).with_suffix(".md").write_text(table)
        print(table)
        return
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    binary = subprocess.run(["bash", str(ROOT / "build_llama_server.sh")], capture_output=True, text=True,
                            check=True).stdout.strip().splitlines()[-1]
    binary = str((ROOT / binary).resolve()) if not binary.startswith("/") else binary
    levels = [int(x) for x in args.levels.split(",")]
    slos = sb.parse_goodput(args.goodput.split())
    path = default_model_path()

    ours = start_lmserve(18123, args.lmserve_args.split())
    llama = start_llama(18124, binary, max(levels))
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_load = time.perf_counter() - t0
    model_name = httpx.get(ours.url + "/v1/models").json()["data"][0]["id"]
    llama_model = httpx.get(llama.url + "/v1/models").json()["data"][0]["id"]
    systems = {"lmserve": lambda reqs, c, r=None: run_server(ours, model_name, reqs, c, r, slos),
               "llama.cpp": lambda reqs, c, r=None: run_server(llama, llama_model, reqs, c, r, slos),
               "transformers": lambda reqs, c, r=None: run_hf(hf, reqs, c)}
    for name, fn in systems.items():  # warm-up, discarded
        fn(requests_for(2, 99), 2)

    results: dict = {name: {} for name in systems}
    for level in levels:
        for rep in range(args.repeats):
            # fresh prompts every repeat: a repeated prompt would be served from the servers' prefix caches
            reqs = requests_for(3 if level == 1 else level, level * 100 + rep)
            for name, fn in systems.items():  # interleaved: A B C A B C
                res = fn(reqs, level)
                results[name].setdefault(str(level), []).append(res)
                print(f"c={level} rep={rep} {name:12} {res['output_throughput']:8.1f} tok/s  "
                      f"TTFT {res['ttft_ms']['median']:8.1f} ms  TPOT {res['tpot_ms']['median']:7.1f} ms", flush=True)

    sweep: dict = {"lmserve": {}, "llama.cpp": {}}
    for rate in [float(x) for x in args.rates.split(",") if x]:
        reqs = requests_for(16, int(rate * 100))
        for name in sweep:
            res = systems[name](reqs, None, rate)
            sweep[name][str(rate)] = res
            print(f"rate={rate} {name:12} goodput {res['goodput']:.3f} req/s  errors {res['failed']}", flush=True)

    # greedy cross-check: first 32 tokens of lmserve and llama.cpp against transformers
    check_reqs = requests_for(4, 7)
    hf_ids = run_hf(hf, check_reqs, 4)["token_ids"]
    tok = httpx.post(ours.url + "/tokenize", json={"prompt": "x"})  # server alive check
    ours_texts = run_server(ours, model_name, check_reqs, 4, None, slos)["texts"]
    llama_texts = run_server(llama, llama_model, check_reqs, 4, None, slos)["texts"]
    from lmserve.engine.tokenizer import Tokenizer

    tk = Tokenizer.from_gguf(path)
    hf_texts = [tk.decode(ids[:32]) for ids in hf_ids]
    match = {"lmserve": sum(t.startswith(h) for t, h in zip(ours_texts, hf_texts)),
             "llama.cpp": sum(t.startswith(h) for t, h in zip(llama_texts, hf_texts)), "of": len(hf_texts)}
    meta = {"machine": {"cpu": _cpu_name(), "flags": _flags(), "cores": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__},
            "load_s": {"lmserve": ours.load_s, "llama.cpp": llama.load_s, "transformers": hf_load},
            "peak_rss_gib": {"lmserve": ours.peak_rss / 2**30, "llama.cpp": llama.peak_rss / 2**30,
                             "transformers": psutil.Process().memory_info().rss / 2**30},
            "first_32_tokens_equal_to_transformers": match, "server_check": tok.status_code}
    ours.stop()
    llama.stop()
    report = {"meta": meta, "levels": results, "rate_sweep": sweep, "config": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    table = render_tables(report, levels)
    Path(args.out).with_suffix(".md").write_text(table)
    print(table)


def render_tables(report: dict, levels: list[int]) -> str:
    lv, m = report["levels"], report["meta"]
    lines = [f"Machine: {m['machine']['cpu']}, {m['machine']['cores']} cores, flags {m['machine']['flags']}; "
             f"torch {m['machine']['torch']}. 256 tokens in, 128 out, greedy, streaming, 2 threads. "
             "transformers: offline static batches (it has no server). Values: median (min-max) of the "
             "interleaved repeats. Ratios are ours / theirs: above 1 is better for tok/s, below 1 for latency."
             + (f" lmserve flags: `{report['config']['lmserve_args']}`." if report["config"].get("lmserve_args") else ""),
             "",
             "| concurrency | metric | lmserve | llama.cpp | transformers | ours/llama.cpp | ours/transformers |",
             "|---|---|---|---|---|---|---|"]
    for level in levels:
        for key, label, higher in (("output_throughput", "output tok/s", True), ("ttft_ms", "TTFT ms (median)", False),
                                   ("tpot_ms", "TPOT ms (median)", False)):
            vals = {}
            for name in ("lmserve", "llama.cpp", "transformers"):
                xs = [r[key] if isinstance(r[key], float) else r[key]["median"] for r in lv[name][str(level)]]
                vals[name] = xs
            med = {k: statistics.median(v) for k, v in vals.items()}
            lines.append(f"| {level} | {label} | {median_range(vals['lmserve'])} | {median_range(vals['llama.cpp'])} | "
                         f"{median_range(vals['transformers'])} | {med['lmserve'] / med['llama.cpp']:.2f} | "
                         f"{med['lmserve'] / med['transformers']:.2f} |")
    errors = {name: sum(r["failed"] for runs in lv[name].values() for r in runs) for name in lv}
    total = {name: sum(r["completed"] + r["failed"] for runs in lv[name].values() for r in runs) for name in lv}
    lines.append("| all | errors | " + " | ".join(f"{errors[n]}/{total[n]}" for n in ("lmserve", "llama.cpp",
                                                                                     "transformers")) + " | | |")
    if report["rate_sweep"]["lmserve"]:
        lines += ["", "| request rate (req/s) | lmserve goodput | llama.cpp goodput | lmserve errors | llama.cpp errors |",
                  "|---|---|---|---|---|"]
    for rate, res in report["rate_sweep"]["lmserve"].items():
        other = report["rate_sweep"]["llama.cpp"][rate]
        lines.append(f"| {rate} | {res['goodput']:.3f} | {other['goodput']:.3f} | {res['failed']} | {other['failed']} |")
    lines += ["", "| | lmserve | llama.cpp | transformers |", "|---|---|---|---|",
              "| load time s | " + " | ".join(f"{m['load_s'][k]:.1f}" for k in ("lmserve", "llama.cpp", "transformers")) + " |",
              "| peak RSS GiB | " + " | ".join(f"{m['peak_rss_gib'][k]:.2f}" for k in ("lmserve", "llama.cpp", "transformers"))
              + " |",
              f"| first 32 greedy tokens = transformers | {m['first_32_tokens_equal_to_transformers']['lmserve']}/"
              f"{m['first_32_tokens_equal_to_transformers']['of']} | {m['first_32_tokens_equal_to_transformers']['llama.cpp']}/"
              f"{m['first_32_tokens_equal_to_transformers']['of']} | reference |"]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _flags() -> str:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "").split()
    keep = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return ",".join(sorted(keep))


if __name__ == "__main__":
    main()
