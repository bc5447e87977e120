"""Where a `lmserve serve` start goes, phase by phase, on the clock the client sees (issue 46).

    python benchmarks/start_timeline.py [--runs 3] [--trees main=/work/main/src,branch=src] [-- serve flags]

Each run starts `lmserve serve` on the embedded model in a child process that wraps the start's functions (the list
PHASES below, wrapped as their modules are imported, so no import moves) and writes when each began and ended, on
which thread, with the thread's CPU seconds; the parent sends one streamed chat of one token as soon as the port
accepts (startup.py's `--send connect` client) and prints every phase against the time since `Popen`. The first
imports of IMPORTS are timed by the same meta-path hook. With --trees the runs alternate
between source trees (PYTHONPATH=tree), so a before/after pair shares the machine's load.
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# module: qualified names; a wrapped function is also swapped in wherever another lmserve module imported it by name
PHASES = {
    "lmserve.cli": ["main"],
    "lmserve.server.listen": ["bind_listener"],
    "lmserve.server.main": ["prepare"],
    "lmserve.server.app": ["build_app"],
    "lmserve.server.state": ["launch_engine", "start_engine"],
    "lmserve.engine.serving": ["open_engine", "warm_up"],
    "lmserve.engine.build": ["build_engine", "_num_blocks"],
    # the function's own module, not the package: the package resolves its re-exports on first use (PEP 562),
    # and reading load_model there as the package is imported would import model_loader, and torch, early
    "lmserve.loader.model_loader": ["load_model"],
    "lmserve.worker.transforms": ["apply_transforms"],
    "lmserve.tokenizer": ["load_tokenizer"],
    "lmserve.worker.model_runner": ["ModelRunner.__init__"],
    "lmserve.cache.kv_cache_manager": ["KVCacheManager.__init__"],
}

# modules whose first import is timed whole (lmserve.server.app's includes torch's)
IMPORTS = ("torch", "lmserve.server.start", "lmserve.server.app", "jinja2")
OUT = sys.stderr


def _emit(**row) -> None:
    OUT.write("@@timeline " + json.dumps(row) + "\n")
    OUT.flush()


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def timed(*a, **k):
        t, c = time.time(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            _emit(phase=name, start=t, end=time.time(), cpu=time.thread_time() - c,
                  thread=threading.current_thread().name)
    return timed


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps PHASES as their modules finish executing; times the first `import torch`."""

    def __init__(self) -> None:
        self.swapped: dict[int, object] = {}  # id(original) -> wrapper
        self.torch_done = False

    def find_spec(self, fullname, path, target=None):
        if fullname not in IMPORTS and not fullname.startswith("lmserve"):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module, hook = spec.loader.exec_module, self

        def run(module):
            t, c = time.time(), time.thread_time()
            exec_module(module)
            if fullname in IMPORTS:
                _emit(phase=f"import {fullname}", start=t, end=time.time(), cpu=time.thread_time() - c,
                      thread=threading.current_thread().name)
            hook.patch(module)
        spec.loader.exec_module = run
        return spec

    def patch(self, module) -> None:
        """Wrap the module's PHASES, and swap wrappers in for the names it imported (cheap: one dict per import;
        the sweep of every loaded module runs only where this module defined a phase)."""
        made = False
        for qual in PHASES.get(module.__name__, []):
            owner, _, attr = qual.rpartition(".")
            target = getattr(module, owner) if owner else module
            fn = getattr(target, attr, None)
            if fn is None:
                continue
            wrapped = _wrap(qual, fn)
            setattr(target, attr, wrapped)
            self.swapped[id(fn)] = wrapped
            made = True
        for key, value in list(vars(module).items()):
            if id(value) in self.swapped:
                setattr(module, key, self.swapped[id(value)])
        for mod in list(sys.modules.values()) if made else ():  # a cycle's module may hold the name already
            if getattr(mod, "__name__", "").startswith("lmserve") and mod is not module:
                for key, value in list(getattr(mod, "__dict__", {}).items()):
                    if id(value) in self.swapped and callable(value):
                        setattr(mod, key, self.swapped[id(value)])


def child(argv: list[str]) -> int:
    _emit(phase="interpreter up", start=float(os.environ["TIMELINE_T0"]), end=time.time(), cpu=time.process_time(),
          thread="MainThread")
    sys.meta_path.insert(0, _Hook())
    from lmserve.cli import main
    return main(argv)


def one_run(env: dict, flags: list[str], importtime: str | None = None) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import httpx

    from benchmarks.startup import cpu_seconds, first_chat_token
    from tests.server_util import free_port

    port = free_port()
    cmd = [sys.executable, __file__, "--child", "serve", "--port", str(port), "--num-threads", "2",
           "--served-model-name", "default", "--log-level", "warning", *flags]
    client = httpx.Client()
    t0 = time.time()
    start = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # not a pipe: -X importtime's lines would fill it and stop the child
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True,
                            env={**env, "TIMELINE_T0": repr(t0), **({"PYTHONPROFILEIMPORTTIME": "1"} if importtime else {})})
    try:
        listening = first_chat_token(client, f"http://127.0.0.1:{port}", start + 180)
        token = time.perf_counter() - start
        cpu = cpu_seconds(proc.pid)
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.seek(0)
        err = log.read()
    if importtime:
        Path(importtime).write_text("\n".join(x for x in err.splitlines() if x.startswith("import time:")) + "\n")
    rows = [json.loads(line.split(" ", 1)[1]) for line in err.splitlines() if line.startswith("@@timeline ")]
    phases = {}
    for r in rows:
        phases.setdefault(r["phase"], {"start_s": r["start"] - t0, "end_s": r["end"] - t0, "cpu_s": r["cpu"],
                                       "thread": r["thread"]})
    return {"first_token_s": token, "listen_s": listening - start, "cpu_s": cpu, "load": os.getloadavg()[0],
            "phases": phases}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--trees", default="", help="name=src_dir,... : alternate the runs between source trees")
    ap.add_argument("--out", default=None, help="write every run as JSON here")
    ap.add_argument("--importtime", default=None, help="write the last run's `-X importtime` lines here")
    ap.add_argument("flags", nargs="*", help="extra serve flags (after --)")
    args = ap.parse_args()
    trees = {n: {**os.environ, "PYTHONPATH": str(Path(s).resolve())}
             for n, s in (t.split("=", 1) for t in args.trees.split(",") if t)} or {"": dict(os.environ)}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.startup import compile_lmserve

    for env in trees.values():  # the .pyc files an install has (this host sets PYTHONDONTWRITEBYTECODE=1)
        compile_lmserve(env)
    runs: dict[str, list[dict]] = {n: [] for n in trees}
    for i in range(args.runs):
        for name, env in trees.items():
            r = one_run(env, args.flags, args.importtime)
            runs[name].append(r)
            print(f"run {i} {name}: first token {r['first_token_s']:.2f} s, listening {r['listen_s']:.2f} s, "
                  f"{r['cpu_s']:.2f} CPU s (load {r['load']:.1f})", flush=True)
    for name, rs in runs.items():
        print(f"\n{name or 'tree'}: medians of {len(rs)} runs, s since Popen (load {rs[0]['load']:.1f}-"
              f"{rs[-1]['load']:.1f})\n| phase | thread | start | end | wall | thread CPU |\n|---|---|---|---|---|---|")
        names = sorted({p for r in rs for p in r["phases"]}, key=lambda p: statistics.median(
            r["phases"][p]["start_s"] for r in rs if p in r["phases"]))
        for p in names:
            xs = [r["phases"][p] for r in rs if p in r["phases"]]
            med = {k: statistics.median(x[k] for x in xs) for k in ("start_s", "end_s", "cpu_s")}
            wall = statistics.median(x["end_s"] - x["start_s"] for x in xs)
            print(f"| {p} | {xs[0]['thread']} | {med['start_s']:.2f} | {med['end_s']:.2f} | {wall:.2f} | "
                  f"{med['cpu_s']:.2f} |")
        print(f"| first token (client) | | | {statistics.median(r['first_token_s'] for r in rs):.2f} | | "
              f"{statistics.median(r['cpu_s'] for r in rs):.2f} (process) |")
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
