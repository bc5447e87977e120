"""Encoder throughput: all-MiniLM-L6-v2 through lmserve's engine against sentence-transformers' encode and
llama.cpp's llama-server --embedding, same run.

    python benchmarks/encoder_throughput.py            # 1,000 sentences, 3 alternating repeats
    python benchmarks/encoder_throughput.py --quick    # 100 sentences, 1 repeat: checks the script
    python benchmarks/encoder_throughput.py --llama-server none    # without the llama-server column

The sentences are 16 to 128 tokens (whole words drawn from a fixed list, token counts checked with the model's
tokenizer), the same for both sides:
  lmserve   one LLMEngine over the real model (its package's model.zip, unzipped to ~/.cache/lmserve/models):
            every sentence a pooling request, the engine's steps batching them without padding
  st        SentenceTransformer(dir).encode(sentences, batch_size=32): batches padded to their longest; in a
            process of its own, under the environment this script started with (its users' defaults: libgomp's
            waiters spin), not the OMP_WAIT_POLICY=PASSIVE that lmserve sets for itself
  llama     llama-server --embedding on the same model converted by llama.cpp's convert_hf_to_gguf.py (--gguf-type,
            default f32: the same weights), its pooling from the file (mean), -t/-tb --threads, --llama-slots
            slots, the batch and micro-batch large enough for every slot's sentence at once; every sentence sent
            as text in one /v1/embeddings request, which it splits over its slots (continuous batching). Its side
            includes HTTP and JSON (about 3 MB of vectors back), which the in-process columns do not pay: its CPU
            time is the server process's alone, for that reason.
All run with --threads threads (default 2), in alternating repeats (lmserve, st, llama, lmserve, ...), because
the machine is shared and only a ratio taken back to back means anything. Throughput is sentences per second
of wall time and of process CPU time; the CPU, its flags and the load average are printed with the results, and
this CPU's float32 ceiling: the linears' FLOPs at the best float32 rate measured before and after the runs, against
sentence-transformers' time (the most any float32 engine could gain on it here). `--bf16-parity` also runs
sentence-transformers under bf16 autocast against its own float32 (time, and the worst 1 - cosine: the precision
that would lift that ceiling, held to the parity row).
Targets (issue 44): lmserve >= 2x sentence-transformers and >= 1.0x llama-server. Results: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# What the user's environment says before lmserve sets its default: sentence-transformers runs in its own process
# under it (`StChild`), as its users run it (libgomp's idle threads spin unless told otherwise)
USER_ENV = dict(os.environ)
import lmserve  # noqa: F401, E402  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
import torch  # noqa: E402
from compare import Proc, _cpu_name, _flags, free_port  # noqa: E402  the same machine description and server runner

from lmserve.config import CacheConfig, EngineConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.pooling_params import PoolingParams  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402
from tests.encoder_models import convert_to_gguf, minilm_dir  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or had not first "
         "one their its new after but who they two her she been other when there all during into school time may "
         "years more most only over city some world would where later up such used many can state about national "
         "out known university united then made").split()
EMBED = SamplingParams(max_tokens=1, pooling=PoolingParams())


def sentences(tokenize, n: int, seed: int = 0) -> list[str]:
    """n sentences of 16..128 tokens (with [CLS] and [SEP]), lengths uniform."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        want = rng.randint(16, 128)
        words = [rng.choice(WORDS) for _ in range(want - 2)]
        text = " ".join(words)
        while len(tokenize(text)) > want:
            words.pop()
            text = " ".join(words)
        if len(tokenize(text)) >= 16:
            out.append(text)
    return out


def linear_flops(cfg, tokens: int) -> float:
    """FLOPs of the encoder's linears over `tokens` tokens (q, k, v and o, and the two MLP matrices: `lmserve bench
    roofline`'s count at no context); attention and norms left out, so the ceiling below bounds from above."""
    from lmserve.bench.roofline import flops_per_token

    return flops_per_token(cfg) * tokens


def fp32_rate(cfg, tokens: int) -> float:
    """Best float32 FLOP/s of the model's MLP pair over a `tokens`-row step, oneDNN's packed weights included
    (`lmserve bench roofline`'s figure), taken three times: this VM's speed drifts."""
    from lmserve.bench.roofline import matmul_tflops

    return max(matmul_tflops(cfg, torch.float32, tokens=tokens) for _ in range(3)) * 1e12


def run_lmserve(engine: LLMEngine, texts: list[str], tag: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) from adding every sentence to the last vector."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i, t in enumerate(texts):
        engine.add_request(f"{tag}-{i}", engine.tokenizer.encode(t), EMBED)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - wall, time.process_time() - cpu


# sentence-transformers' side: a process of its own that imports torch first, loads the model once, and encodes the
# sentences each time a line comes in, answering (wall s, its CPU s)
ST_CHILD = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")
for line in sys.stdin:
    texts = json.loads(line)
    wall, cpu = time.perf_counter(), time.process_time()
    model.encode(texts, batch_size=32)
    print(json.dumps([time.perf_counter() - wall, time.process_time() - cpu]), flush=True)
"""


class StChild:
    """SentenceTransformer(dir).encode(texts, batch_size=32) in its own process, under the user's environment (not
    the OMP_WAIT_POLICY=PASSIVE that lmserve's import set in this one: spinning waiters ran its encode ~8% faster
    here on a Zen 4)."""

    def __init__(self, path: Path, threads: int) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", ST_CHILD, str(path), str(threads)], env=USER_ENV,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def encode(self, texts: list[str]) -> tuple[float, float]:
        self.p.stdin.write(json.dumps(texts) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the sentence-transformers process exited ({self.p.wait()})")
        wall, cpu = json.loads(line)
        return wall, cpu

    def stop(self) -> None:
        """End the child (EOF on its input), killing it if it does not go; never raises."""
        try:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


# --bf16-parity: the one faster precision a user could pick, against the 1e-5 cosine row. sentence-transformers
# under torch.autocast(bfloat16) against itself in float32, same sentences, its own process, the two alternating
# `repeats` times (CPU autocast runs the linears, attention and softmax in bf16; the LayerNorms come back to float32
# where a bf16 output meets the float32 residual); the median time of each and the worst and median 1 - cosine
BF16_CHILD = """
import json, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from sentence_transformers import SentenceTransformer
texts = json.loads(sys.stdin.read())
model = SentenceTransformer(sys.argv[1], device="cpu")
def encode():
    t = time.perf_counter()
    out = model.encode(texts, batch_size=32, convert_to_tensor=True, normalize_embeddings=True)
    return out.float(), time.perf_counter() - t
def bf16():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return encode()
model.encode(texts[:32], batch_size=32)
bf16()  # warm-up: autocast's first pass
f32, b16 = [], []
for _ in range(int(sys.argv[3])):
    ref, t = encode()
    f32.append(t)
    out, t = bf16()
    b16.append(t)
d = 1 - torch.nn.functional.cosine_similarity(out, ref, dim=-1)
print(json.dumps({"float32_s": statistics.median(f32), "bf16_s": statistics.median(b16), "repeats": len(f32),
                  "max_1_minus_cos": d.max().item(), "median_1_minus_cos": d.median().item()}))
"""


def bf16_parity(path: Path, texts: list[str], threads: int, repeats: int) -> dict:
    """BF16_CHILD's numbers, or {"error": its stderr's tail} (the other results are kept either way)."""
    res = subprocess.run([sys.executable, "-c", BF16_CHILD, str(path), str(threads), str(repeats)],
                         input=json.dumps(texts), capture_output=True, text=True, env=USER_ENV)
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_st(model: StChild, texts: list[str]) -> tuple[float, float]:
    return model.encode(texts)


def start_llama(binary: str, gguf: Path, args: argparse.Namespace) -> Proc:
    """llama-server --embedding on `gguf`: --llama-slots slots of 256 tokens (every sentence fits one), the batch and
    the micro-batch one slot-full each (a non-causal model's sequence must sit in one micro-batch)."""
    port, slots = free_port(), args.llama_slots
    batch = max(2048, 256 * slots // 4)
    cmd = [binary, "-m", str(gguf), "--embedding", "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-c", str(256 * slots),
           "-b", str(batch), "-ub", str(batch), "--no-webui"]
    return Proc("llama-server", cmd, f"http://127.0.0.1:{port}", {"LD_LIBRARY_PATH": str(Path(binary).parent)})


def run_llama(proc: Proc, texts: list[str]) -> tuple[float, float]:
    """(wall seconds, the server's CPU seconds) for every sentence's vector, sent in one request."""
    import httpx
    import psutil

    server = psutil.Process(proc.p.pid)
    cpu0, wall = sum(server.cpu_times()[:2]), time.perf_counter()
    r = httpx.post(proc.url + "/v1/embeddings", json={"input": texts, "model": "minilm"}, timeout=3600)
    wall = time.perf_counter() - wall
    r.raise_for_status()
    assert len(r.json()["data"]) == len(texts)
    return wall, sum(server.cpu_times()[:2]) - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--llama-server", default=str(ROOT / ".cache" / "llama.cpp" / "build" / "bin" / "llama-server"),
                    help="llama-server binary (benchmarks/build_llama_server.sh builds it); 'none': no such column")
    ap.add_argument("--llama-slots", type=int, default=32, help="llama-server's -np")
    ap.add_argument("--gguf-type", default="f32", choices=["f32", "f16"], help="the GGUF llama-server loads")
    ap.add_argument("--bf16-parity", action="store_true",
                    help="also time sentence-transformers under bf16 autocast and its cosine to float32 (the 1e-5 row)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    if args.quick:
        args.sentences, args.repeats = 100, 1
    torch.set_num_threads(args.threads)
    path = minilm_dir()
    engine = LLMEngine(_engine_config(path, args))
    texts = sentences(engine.tokenizer.encode, args.sentences)
    tokens = sum(len(engine.tokenizer.encode(t)) for t in texts)
    llama = None
    runs: dict[str, list[tuple[float, float]]] = {"lmserve": [], "st": []}
    st = StChild(path, args.threads)
    try:  # from the child's start: whatever fails below, it is stopped (and llama-server, once started)
        if args.llama_server != "none":
            gguf = convert_to_gguf(path, args.gguf_type,
                                   path.parent / "all-MiniLM-L6-v2-gguf" / f"all-MiniLM-L6-v2-{args.gguf_type}.gguf")
            llama = start_llama(args.llama_server, gguf, args)
        run_lmserve(engine, texts[:32], "warm")
        run_st(st, texts[:32])
        if llama is not None:
            run_llama(llama, texts[:32])
            runs["llama"] = []
        load = os.getloadavg()
        rates = [fp32_rate(engine.model_config, args.max_num_batched_tokens)]
        for r in range(args.repeats):
            runs["lmserve"].append(run_lmserve(engine, texts, f"r{r}"))
            runs["st"].append(run_st(st, texts))
            if llama is not None:
                runs["llama"].append(run_llama(llama, texts))
        rates.append(fp32_rate(engine.model_config, args.max_num_batched_tokens))
    finally:
        st.stop()  # never raises: llama-server is stopped too
        if llama is not None:
            llama.stop()
    result = {"cpu": _cpu_name(), "flags": _flags(), "threads": args.threads, "sentences": len(texts),
              "tokens": tokens, "load_before": load, "load_after": os.getloadavg(),
              **{name: {"wall_s": statistics.median(w for w, _ in v), "cpu_s": statistics.median(c for _, c in v),
                        "sentences_per_s": len(texts) / statistics.median(w for w, _ in v)}
                 for name, v in runs.items()}}
    result["speedup_wall"] = result["st"]["wall_s"] / result["lmserve"]["wall_s"]
    result["speedup_cpu"] = result["st"]["cpu_s"] / result["lmserve"]["cpu_s"]
    # No float32 engine can beat sentence-transformers by more than this on this CPU: its time over the linears'
    # FLOPs at the best rate measured (the 1e-5 cosine parity holds float32)
    flops = linear_flops(engine.model_config, tokens)
    result["fp32_ceiling"] = {"linear_tflop": flops / 1e12, "best_gflop_s": max(rates) / 1e9,
                              "linears_at_peak_s": flops / max(rates),
                              "max_speedup_wall": result["st"]["wall_s"] / (flops / max(rates))}
    if args.bf16_parity:
        result["bf16_autocast"] = bf16_parity(path, texts, args.threads, args.repeats)
    if llama is not None:
        result["llama_server"] = {"binary": args.llama_server, "gguf": args.gguf_type, "slots": args.llama_slots}
        result["vs_llama_wall"] = result["llama"]["wall_s"] / result["lmserve"]["wall_s"]
        result["vs_llama_cpu"] = result["llama"]["cpu_s"] / result["lmserve"]["cpu_s"]
    print(f"CPU: {result['cpu']} ({args.threads} threads); {len(texts)} sentences, {tokens} tokens; "
          f"load {load[0]:.1f} -> {result['load_after'][0]:.1f}")
    for name in runs:
        print(f"{name:8s} {result[name]['sentences_per_s']:8.1f} sentences/s  (wall {result[name]['wall_s']:.2f} s, "
              f"CPU {result[name]['cpu_s']:.2f} s)")
    print(f"lmserve / sentence-transformers: {result['speedup_wall']:.2f}x wall, {result['speedup_cpu']:.2f}x CPU "
          "(target >= 2x)")
    c = result["fp32_ceiling"]
    print(f"fp32 ceiling: {c['linear_tflop']:.3f} TFLOP of linears at {c['best_gflop_s']:.0f} GFLOP/s (the best "
          f"measured) take {c['linears_at_peak_s']:.2f} s: at most {c['max_speedup_wall']:.2f}x sentence-transformers")
    if llama is not None:
        print(f"lmserve / llama-server ({args.gguf_type} GGUF): {result['vs_llama_wall']:.2f}x wall, "
              f"{result['vs_llama_cpu']:.2f}x CPU (target >= 1.0x)")
    if args.bf16_parity:
        b = result["bf16_autocast"]
        if "error" in b:
            print(f"sentence-transformers under bf16 autocast failed: {b['error']}")
        else:
            print(f"sentence-transformers under bf16 autocast: {b['float32_s'] / b['bf16_s']:.2f}x its float32 speed "
                  f"(medians of {b['repeats']}), 1 - cosine to float32 max {b['max_1_minus_cos']:.2e}, median "
                  f"{b['median_1_minus_cos']:.2e} (the parity row: within 1e-5)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


def _engine_config(path: Path, args: argparse.Namespace) -> EngineConfig:
    from dataclasses import replace

    cfg = EngineConfig(model=str(path), num_threads=args.threads, cache=CacheConfig(enable_prefix_caching=False))
    return replace(cfg, scheduler=replace(cfg.scheduler, max_num_seqs=256,
                                          max_num_batched_tokens=args.max_num_batched_tokens, step_seconds=None))


if __name__ == "__main__":
    main()
