"""Host milliseconds per decode step of a served model: what a step costs besides the model's forward.

    python benchmarks/served_step_host.py --trees main=/work/main/src,branch=src [--levels 1,16,32 --rounds 2]

Each round starts `lmserve serve` once per source tree, in turn (PYTHONPATH=tree, the embedded SmolLM2 Q4_1,
2 threads), and drives each concurrency level c with c streamed completions of 256 random token ids in and
`--output-len` out (greedy, EOS ignored), as compare.py does. Inside the server a wrapper (this file, `--serve`)
reads thread CPU clocks at each step start; one engine cycle is one step start to the next (drain the inbox,
step, hand the deltas to the event loop, step listeners). Per cycle:

- engine host: the engine thread's CPU time minus its CPU time inside the model (`model(...)` and
  `compute_logits`): scheduler, inputs, sampler, update, detokenizing, publishing;
- loop: the event-loop thread's CPU time over the same cycle (HTTP, SSE encoding, stream bookkeeping);
- host = engine host + loop, the per-step cost that the forward does not hide (both run under the GIL);
- wall and forward wall, for the step time the client sees.

Only decode cycles with exactly c rows count (prefill and the ragged tail excluded); the table has each tree's
median over rounds of the per-run medians, and the client's TPOT and output tok/s. CPU times do not depend on
the machine's load the way wall times do; the load average is recorded with every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"


# -- inside the server (--serve) --------------------------------------------------------------------

def _install_probe(dump_path: str) -> None:
    """Wrap LLMEngine.step to record per-cycle thread CPU; SIGUSR1 writes the records to dump_path and clears them."""
    from lmserve.engine.llm_engine import LLMEngine

    main_clock = time.pthread_getcpuclockid(threading.main_thread().ident)
    records: list[dict] = []
    state = {"prev": None, "model": None, "fwd_cpu": 0.0, "fwd_wall": 0.0}

    def timed(fn):
        def call(*a, **kw):
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                state["fwd_cpu"] += time.thread_time() - c
                state["fwd_wall"] += time.perf_counter() - w
        return call

    original = LLMEngine.step

    def step(self):
        if state["model"] is None:
            model = state["model"] = self.loaded.model
            model.forward = timed(model.forward)
            model.compute_logits = timed(model.compute_logits)
        now = (time.perf_counter(), time.thread_time(), time.clock_gettime(main_clock), time.process_time())
        prev = state["prev"]
        if prev is not None:  # the cycle that began at the previous step start ends here
            mark, stats = prev
            records.append({"rows": stats.batch_size, "prefill": stats.num_prefill_tokens,
                            "wall": now[0] - mark[0], "engine_cpu": now[1] - mark[1], "loop_cpu": now[2] - mark[2],
                            "process_cpu": now[3] - mark[3], "fwd_cpu": state["fwd_cpu"],
                            "fwd_wall": state["fwd_wall"]})
        state["fwd_cpu"] = state["fwd_wall"] = 0.0
        out = original(self)
        # an empty step (nothing scheduled) ends no cycle worth keeping
        state["prev"] = (now, self.last_step) if out or self.has_unfinished() else None
        return out

    LLMEngine.step = step

    def dump(signum, frame):
        Path(dump_path).write_text(json.dumps({"records": records[:], "load": os.getloadavg()}))
        records.clear()
        state["prev"] = None

    signal.signal(signal.SIGUSR1, dump)


def serve(argv: list[str]) -> None:
    _install_probe(os.environ["STEP_HOST_DUMP"])
    from lmserve.cli import main
    sys.exit(main(["serve", *argv]))


# -- the driver ---------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `lmserve serve` of a source tree, with the probe installed."""

    def __init__(self, src: str, args) -> None:
        self.port, self.dump = _free_port(), tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, __file__, "--serve", "--port", str(self.port), "--num-threads", str(args.threads),
               "--max-num-seqs", str(max(args.levels)), "--log-level", "warning", "--kv-cache-memory", str(2**31),
               # a fixed budget: the fitted one shrinks with the load, and a loaded host then never reaches c full rows
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()), "STEP_HOST_DUMP": self.dump}
        self.p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.p.poll() is not None:
                raise RuntimeError(f"server exited: {self.p.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError("server did not start")

    def take(self) -> dict:
        """The records since the last take (the server writes them on SIGUSR1)."""
        if os.path.exists(self.dump):
            os.unlink(self.dump)
        self.p.send_signal(signal.SIGUSR1)
        for _ in range(200):
            if os.path.exists(self.dump):
                try:
                    return json.loads(Path(self.dump).read_text())
                except json.JSONDecodeError:
                    pass  # still being written
            time.sleep(0.05)
        raise RuntimeError("no dump from the server")

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def level(server: Server, c: int, args, seed: int, warm_up: bool = False) -> dict | None:
    """Run c streams at concurrency c; the medians of the full decode cycles and the client's view."""
    from lmserve.bench import serve as sb

    reqs = sb.random_dataset(c, args.input_len, args.output_len, 0.0, 49152, seed)
    server.take()  # drop what came before
    results, wall = asyncio.run(sb.run_load(f"http://127.0.0.1:{server.port}", MODEL_NAME, "completions", reqs, c,
                                            None, None, True, seed, progress=False))
    dumped = server.take()
    summary = sb.summarize(results, wall, {}, 0.0)
    full = [r for r in dumped["records"] if r["rows"] == c and r["prefill"] == 0]
    if warm_up:
        return None
    if os.environ.get("STEP_HOST_DEBUG"):
        print([(r["rows"], r["prefill"]) for r in dumped["records"]], file=sys.stderr)
    if not full or summary["failed"]:
        raise RuntimeError(f"c={c}: {len(full)} full decode cycles, {summary['failed']} failed {summary['errors']}")

    def med(fn) -> float:
        return statistics.median(fn(r) for r in full) * 1000

    # c=1: the prompt's steps (prefill), against the client's TTFT: what besides the forward the first token waits for
    prefill = [r for r in dumped["records"] if r["prefill"] > 0] if c == 1 else []
    first = {"prefill_steps": len(prefill), "prefill_wall_ms": sum(r["wall"] for r in prefill) * 1000,
             "prefill_fwd_wall_ms": sum(r["fwd_wall"] for r in prefill) * 1000,
             "prefill_host_ms": sum(r["engine_cpu"] - r["fwd_cpu"] + r["loop_cpu"] for r in prefill) * 1000}

    return {"cycles": len(full), "load": dumped["load"][0],
            "engine_host_ms": med(lambda r: r["engine_cpu"] - r["fwd_cpu"]), "loop_ms": med(lambda r: r["loop_cpu"]),
            "host_ms": med(lambda r: r["engine_cpu"] - r["fwd_cpu"] + r["loop_cpu"]),
            "fwd_cpu_ms": med(lambda r: r["fwd_cpu"]), "process_cpu_ms": med(lambda r: r["process_cpu"]),
            "wall_ms": med(lambda r: r["wall"]), "fwd_wall_ms": med(lambda r: r["fwd_wall"]),
            "tpot_ms": summary["tpot_ms"]["median"], "ttft_ms": summary["ttft_ms"]["median"],
            "output_tok_s": summary["output_throughput"], **(first if prefill else {})}


def run(args) -> dict:
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in args.levels} for name in trees}
    for r in range(args.rounds):
        for name, src in trees.items():
            server = Server(src, args)
            try:
                level(server, 2, args, 999, warm_up=True)  # warm-up: first-shape costs, the loop's first connections
                for c in args.levels:
                    res = level(server, c, args, r)
                    runs[name][c].append(res)
                    print(f"round {r} {name} c={c}: host {res['host_ms']:.2f} ms (engine {res['engine_host_ms']:.2f}, "
                          f"loop {res['loop_ms']:.2f}), forward CPU {res['fwd_cpu_ms']:.1f} ms, wall "
                          f"{res['wall_ms']:.1f} ms, TPOT {res['tpot_ms']:.1f} ms, load {res['load']:.1f}",
                          flush=True)
            finally:
                server.stop()
    return {"trees": trees, "runs": {n: {str(c): v for c, v in lv.items()} for n, lv in runs.items()},
            "args": {k: v for k, v in vars(args).items() if k != "out"}, "machine": _machine()}


def table(report: dict) -> str:
    keys = ("host_ms", "engine_host_ms", "loop_ms", "fwd_cpu_ms", "wall_ms", "fwd_wall_ms", "tpot_ms", "output_tok_s")
    lines = ["| tree | rows | host CPU ms | engine host | loop | forward CPU ms | step wall ms | forward wall ms | "
             "TPOT ms | output tok/s | loads |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, levels in report["runs"].items():
        for c, rs in levels.items():
            cells = " | ".join(f"{statistics.median(x[k] for x in rs):.1f}" if k in ("fwd_cpu_ms", "wall_ms",
                               "fwd_wall_ms", "tpot_ms", "output_tok_s") else
                               f"{statistics.median(x[k] for x in rs):.2f}" for k in keys)
            loads = ", ".join(f"{x['load']:.1f}" for x in rs)
            lines.append(f"| {name} | {c} | {cells} | {loads} |")
    return "\n".join(lines)


def _machine() -> dict:
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")), "?")
    return {"cpu": name, "cores": os.cpu_count(), "load_at_end": os.getloadavg(),
            "flags": [f for f in flags if f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni")]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=f"main=/work/main/src,branch={ROOT / 'src'}", help="name=src_dir,...")
    ap.add_argument("--levels", default="1,16,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--out", default=None, help="write the JSON report here (and a .md table beside it)")
    args = ap.parse_args()
    report = run(args)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        m = report["machine"]
        Path(args.out).with_suffix(".md").write_text(
            f"# Served per-step host CPU (benchmarks/served_step_host.py)\n\n{m['cpu']}, {m['cores']} cores, flags "
            f"{' '.join(m['flags'])}; load average per run in the last column.\n\n{table(report)}\n")


if __name__ == "__main__":
    main()
