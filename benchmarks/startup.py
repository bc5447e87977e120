"""Start to first token of `lmserve serve`, and its peak RSS, for several flag sets (alternating runs).

    python benchmarks/startup.py --variants "--quantization none" "" --repeats 3
    python benchmarks/startup.py --variants "" --send connect --trees main=/tmp/main/src,branch=src --repeats 5

`--floor` adds a row for a process that only imports torch, FastAPI and uvicorn (the collector off, as in a serve)
and exits (wall and CPU seconds; no RSS).

Each run starts a fresh `lmserve serve` process on the embedded model (the native extension must already be
built: run any server once first), polls /health, and sends one streamed completion of one token as soon as
the server answers; the time is from `Popen` to that token's SSE chunk, with the CPU time the server process
had used by then (steadier than the wall clock on a shared machine). Peak RSS is the process's VmHWM read
after the token. Variants alternate run by run, so a noisy shared machine hits them alike.

`--send connect` is a client that starts the server and sends at once: a streamed chat request of one token as soon
as the port accepts a connection (a 503 is retried after 20 ms, as a client of a server that refuses while loading
must), timed to its first content chunk. `--trees name=src,...` runs every variant under each source tree
(PYTHONPATH=src), round by round, so a before/after pair shares the machine's load.

The lmserve package the servers import is byte-compiled first, as scripts/install.sh and a wheel install leave it:
where PYTHONDONTWRITEBYTECODE=1, a checkout without .pyc files would time compiling ~200 modules (0.4 CPU s).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import free_port  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far: on a shared machine, steadier than the wall clock."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_hwm_gib(pid: int) -> float:
    """Peak resident set size of a process (Linux /proc VmHWM), GiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def first_token(client: httpx.Client, url: str, deadline: float) -> None:
    """Poll until the server streams one completion token (503 while the model loads)."""
    body = {"model": "default", "prompt": "Hello", "max_tokens": 1, "stream": True, "temperature": 0}
    while time.perf_counter() < deadline:
        try:
            if client.get(url + "/health", timeout=5).status_code != 200:
                time.sleep(0.02)
                continue
            with client.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        return
        except httpx.TransportError:
            time.sleep(0.02)
    raise TimeoutError("no token before the deadline")


CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "stream": True,
        "temperature": 0}


def first_chat_token(client: httpx.Client, url: str, deadline: float) -> float:
    """Send a streamed chat as soon as the port accepts (no /health poll), retrying 503s; return at its first chunk
    with content. Returns when (perf_counter) the port first accepted a connection."""
    host, port = url.removeprefix("http://").split(":")
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            break
        except OSError:
            if time.perf_counter() > deadline:
                raise TimeoutError("the port never opened") from None
            time.sleep(0.005)
    listening = time.perf_counter()
    while time.perf_counter() < deadline:
        try:
            with client.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=120) as r:
                if r.status_code == 503:
                    r.read()
                    time.sleep(0.02)
                    continue
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        return listening
        except httpx.TransportError:  # not listening yet
            time.sleep(0.005)
    raise TimeoutError("no token before the deadline")


def compile_lmserve(env: dict | None = None) -> None:
    """Write the .pyc files of the lmserve package the servers will import (a user's install has them)."""
    out = subprocess.run([sys.executable, "-c", "import lmserve, os; print(os.path.dirname(lmserve.__file__))"],
                         capture_output=True, text=True, check=True, env=env)
    compileall.compile_dir(out.stdout.strip(), quiet=1)


def one_run(flags: list[str], threads: int, send: str = "health", env: dict | None = None) -> dict:
    """One server start: seconds from Popen to the first streamed token, and peak RSS after it."""
    port = free_port()
    cmd = [sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port), "--num-threads", str(threads),
           "--served-model-name", "default", "--log-level", "warning", *flags]
    client = httpx.Client()  # one for every poll, made before the clock starts (httpx.get makes one per call)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        listening = first_chat_token(client, url, start + 180) if send == "connect" else first_token(client, url,
                                                                                                      start + 180)
        seconds = time.perf_counter() - start
        listen_s = {"listen_s": listening - start} if listening is not None else {}
        return {"first_token_s": seconds, "cpu_s": cpu_seconds(proc.pid), "peak_rss_gib": vm_hwm_gib(proc.pid),
                **listen_s}
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)


# what any torch + FastAPI server imports before it can answer, with the cyclic collector off as `lmserve serve` has it
FLOOR = "import gc; gc.disable(); import torch, fastapi, uvicorn"


def floor_run() -> dict:
    """The same clocks for a process that only imports torch, FastAPI and uvicorn and exits: the start a server of
    this stack cannot go below on this machine, whatever it does after its imports."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR], check=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_token_s": seconds, "cpu_s": round(cpu, 2), "peak_rss_gib": float("nan")}  # not read: it exited


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["--quantization none", ""],
                    help="`lmserve serve` flag sets to compare, each one string ('' = the defaults)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--floor", action="store_true", help=f"also time `python -c '{FLOOR}'` alone, alternating with "
                    "the variants (the row it gives: the imports' share of a start)")
    ap.add_argument("--send", choices=("health", "connect"), default="health",
                    help="health: a completion once /health says 200; connect: a chat as soon as the port accepts")
    ap.add_argument("--trees", default="", help="name=src_dir,... : run every variant under each source tree")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    trees = {name: {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
             for name, src in (t.split("=", 1) for t in args.trees.split(",") if t)} or {"": None}
    for env in trees.values():
        compile_lmserve(env)
    cases = {" ".join(x for x in (tree, v) if x): (v, env) for tree, env in trees.items() for v in args.variants}
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    if args.floor:
        runs[FLOOR] = []
    for _ in range(args.repeats):
        for name, (v, env) in cases.items():
            runs[name].append(one_run(v.split(), args.threads, args.send, env) | {"load": os.getloadavg()[0]})
            last = runs[name][-1]
            print(f"{name or '(defaults)'}: {last['first_token_s']:.2f} s, listening at {last.get('listen_s', -1):.2f} s, "
                  f"{last['cpu_s']:.2f} CPU s (load {last['load']:.1f})", flush=True)
        if args.floor:
            runs[FLOOR].append(floor_run())
    result = {v or "(defaults)": {"first_token_s_median": statistics.median(r["first_token_s"] for r in rs),
                                  "cpu_s_median": statistics.median(r["cpu_s"] for r in rs),
                                  "peak_rss_gib_median": statistics.median(r["peak_rss_gib"] for r in rs),
                                  "listen_s_median": statistics.median(r.get("listen_s", float("nan")) for r in rs),
                                  "runs": rs} for v, rs in runs.items()}
    for name, r in result.items():
        print(f"{name:28} first token {r['first_token_s_median']:.2f} s ({r['cpu_s_median']:.2f} CPU s)   "
              f"peak RSS {r['peak_rss_gib_median']:.2f} GiB   listening at {r['listen_s_median']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
