"""Speculative decoding on the embedded SmolLM2 GGUF (float32, 2 threads): what it gains and what it costs, one run.

    # full run: old = commit 02e3df1 (checked out by the script into /tmp/lmserve-base-<sha>), new = this checkout
    python benchmarks/spec_decode.py --baseline-commit 02e3df1
    # new code elsewhere (e.g. uncommitted work in another checkout), baseline tree already there
    python benchmarks/spec_decode.py --tree /work/main --baseline-tree /tmp/lmserve-base-02e3df1
    # tiny sizes, to check the script: minutes, nearly all of it loading the engines (~30 s each) and, on the
    # first run per tree, building its kernels (results go to the git-ignored benchmarks/.cache/)
    python benchmarks/spec_decode.py --baseline-commit HEAD --quick [--parts off]

Parts (`--parts off,ngram,chat,draft`, any subset):
  off    speculation off, old engine (`--baseline-*`) vs new (`--tree`): single-stream decode tok/s (first to
         last token of one greedy request, EOS ignored), offline tok/s (distinct prompts, greedy, EOS ignored) and
         the engine's overhead per batch-1 decode step = mean(LLMEngine.step) - mean(model forward), the forward
         timed by wrapping `llm.engine.runner.model.forward` (the LM head, `compute_logits`, is reported apart).
         "Must not cost speed" is checked as new/old >= 0.97 (repeats on this host differ by a few percent);
         greedy tokens of old and new are compared too.
  ngram  input-grounded prompts ("Repeat the following text exactly", "Fix the typo in this code"), one
         request at a time, greedy: decode tok/s with n-gram speculation vs without (target >= 2x), the
         acceptance rate, and how many outputs differ from speculation off (greedy must not change tokens).
  chat   open-ended chat prompts, greedy and temperature 0.8 (seeded, and without a seed): n-gram speculation on vs off
         (target >= 0.95x: speculation must back off when nothing matches).
  draft  the embedded model as its own draft model: acceptance must be 100% for greedy (asserted; the run
         exits non-zero after writing its report otherwise) and tok/s vs off is the cost of the draft.

Every engine lives in its own process (benchmarks/spec_workloads.py with PYTHONPATH=<tree>/src), is loaded and
warmed up once, and runs the measurements it is sent, one process at a time; each repeat alternates the sides
(old, new, old, new...). Each tree gets its own LMSERVE_CACHE_DIR (<--cache-dir>/spec_decode/<tree>): the kernel
cache key covers the C++ sources but ninja's build files name their paths, so two trees with the same sources
sharing one directory would rebuild the kernels (minutes) each time the other tree loads.
Load time is not timed. Medians over `--repeats` are reported with min-max. Acceptance comes from the engine's
counters `llm.engine.spec_stats` (num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos).
Decode tok/s counts the tokens after the first over the time from the first token to the last, so prefill (and
prefix-cache hits on repeated prompts) stay out of it. JSON to `--out`, a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from compare import _cpu_name, _flags  # benchmarks/compare.py: the same machine description
from spec_workloads import SPEC_COUNTERS

ROOT = Path(__file__).resolve().parent
PARTS = ("off", "ngram", "chat", "draft")

# Sizes of the full run and of --quick; a flag given on the command line wins over both.
FULL = dict(repeats=2, output_len=128, prompt_len=128, offline_prompts=32, offline_output_len=64,
            ngram_prompts=20, chat_prompts=10, grounded_tokens=300)
QUICK = dict(repeats=2, output_len=8, prompt_len=32, offline_prompts=4, offline_output_len=8,
             ngram_prompts=2, chat_prompts=2, grounded_tokens=300)

# -- engines in subprocesses and the plan ------------------------------------------------------------------


class Worker:
    """An engine in its own process with PYTHONPATH=<tree>/src; `call` sends one op and waits for its reply."""

    def __init__(self, name: str, tree: Path, kwargs: dict, env: dict, needs_spec: bool = False) -> None:
        self.name, self.tree = name, tree
        self.p = subprocess.Popen([sys.executable, str(ROOT / "spec_workloads.py")], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env={**os.environ, **env, "PYTHONPATH": str(tree / "src")})
        self.info = self.call("load", tree=str(tree), kwargs=kwargs, needs_spec=needs_spec)

    def call(self, op: str, **args) -> dict:
        self.p.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.name!r} exited (status {self.p.wait()}) during {op}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"engine {self.name!r} failed in {op}:\n{out['error']}")
        return out

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


@dataclass(frozen=True)
class Measure:
    """One measurement of one repeat: its table row, its side of the comparison, the engine and the workload."""

    part: str
    row: str
    side: str  # old | new (part off), off | on (the others)
    engine: str  # a key of the workers dict
    op: str  # a Bench method
    args: dict


def plan(part: str, a: argparse.Namespace, r: int) -> list[Measure]:
    """Repeat r of one part, sides alternating; part off takes new prompts every repeat (no prefix-cache hits)."""
    if part == "off":
        first = r * (a.offline_prompts + 1)
        single = dict(first=first, prompt_len=a.prompt_len, max_tokens=a.output_len)
        offline = dict(first=first + 1, n=a.offline_prompts, prompt_len=a.prompt_len, max_tokens=a.offline_output_len)
        return [Measure(part, row, side, side, op, args) for row, op, args in
                (("single_stream", "single", single), ("offline", "offline", offline)) for side in ("old", "new")]
    grounded = dict(kind="grounded", n=a.ngram_prompts, temperature=0.0, seed=None)
    greedy = dict(kind="chat", n=a.chat_prompts, temperature=0.0, seed=None)
    sampled = dict(kind="chat", n=a.chat_prompts, temperature=a.temperature, seed=a.seed)
    # unseeded too: the draft policy plans seeded sampled requests on a fixed cost curve (their tokens must not
    # depend on their batch) and everything else on measured step costs
    unseeded = {**sampled, "seed": None}
    rows = {"ngram": [("input_grounded", grounded)],
            "chat": [("greedy", greedy), ("sampled", sampled), ("sampled_unseeded", unseeded)],
            "draft": [("greedy", greedy)]}[part]
    on = "draft" if part == "draft" else "ngram"
    return [Measure(part, row, side, engine, "streams",
                    {**args, "max_tokens": a.output_len, "grounded_tokens": a.grounded_tokens})
            for row, args in rows for side, engine in (("off", "new"), ("on", on))]


def engine_specs(a: argparse.Namespace, model_path: str) -> dict[str, tuple[str, dict]]:
    """name -> (tree role, LLM keyword arguments) of every engine the requested parts use."""
    base = dict(dtype=a.dtype, num_threads=a.threads, max_num_seqs=max(a.offline_prompts, 4),
                max_num_batched_tokens=2048, kv_cache_memory=a.kv_cache_bytes)
    ngram = {"method": "ngram", "num_speculative_tokens": a.num_spec_tokens, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}
    draft = {"method": "draft_model", "model": model_path, "num_speculative_tokens": a.num_spec_tokens}
    specs = {"old": ("old", base), "new": ("new", base), "ngram": ("new", {**base, "speculative_config": ngram}),
             "draft": ("new", {**base, "speculative_config": draft})}
    used = {m.engine for p in a.parts for m in plan(p, a, 0)}
    return {k: v for k, v in specs.items() if k in used}


def start_engines(a: argparse.Namespace, trees: dict[str, Path], model_path: str) -> dict[str, Worker]:
    """Load every engine before measuring anything (speculative ones first: the likeliest to fail, fail early)."""
    workers: dict[str, Worker] = {}
    specs = engine_specs(a, model_path)
    try:
        for name in sorted(specs, key=lambda k: "speculative_config" not in specs[k][1]):
            role, kwargs = specs[name]
            print(f"loading engine {name} ({trees[role]})", flush=True)
            env = {"LMSERVE_CACHE_DIR": kernel_cache(a.cache_dir, trees[role]), "OMP_NUM_THREADS": str(a.threads)}
            workers[name] = Worker(name, trees[role], kwargs, env, needs_spec="speculative_config" in kwargs)
    except RuntimeError as e:
        for w in workers.values():
            w.close()
        hint = " (speculative decoding not merged yet? `--parts off` runs without it)" if name in ("ngram", "draft") \
            else ""
        raise SystemExit(f"could not start engine {name!r}{hint}:\n{e}") from None
    return workers


def run_all(a: argparse.Namespace, workers: dict[str, Worker]) -> dict[tuple[str, str, str], list[dict]]:
    """Every part's repeats in order; an engine is closed once no later part needs it (less memory held)."""
    results: dict[tuple[str, str, str], list[dict]] = {}
    for i, part in enumerate(a.parts):
        for r in range(a.repeats):
            for m in plan(part, a, r):
                res = workers[m.engine].call(m.op, **m.args)
                results.setdefault((m.part, m.row, m.side), []).append(res)
                print(f"{part:5} {m.row:14} {m.side:3} repeat {r}: {res['tok_s']:8.2f} tok/s", flush=True)
        later = {m.engine for p in a.parts[i + 1:] for m in plan(p, a, 0)}
        for name in [n for n in workers if n not in later]:
            workers.pop(name).close()
    return results


def sides(part: str) -> tuple[str, str]:
    """The two sides a part compares, baseline first."""
    return ("old", "new") if part == "off" else ("off", "on")


def summarize(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def mismatches(a_runs: list[dict], b_runs: list[dict]) -> dict:
    """Outputs (over all repeats) whose tokens differ between two sides, and the first differing position of each."""
    firsts = []
    for ra, rb in zip(a_runs, b_runs):
        for x, y in zip(ra["tokens"], rb["tokens"]):
            if x != y:
                firsts.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    total = sum(len(r["tokens"]) for r in a_runs)
    return {"outputs": total, "differ": len(firsts), "first_difference_at": firsts}


def acceptance(runs: list[dict]) -> dict:
    """Spec counters summed over repeats, with the acceptance rate overall and per draft position."""
    tot = {k: sum(r["spec"][k] for r in runs) for k in SPEC_COUNTERS}
    width = max(len(r["spec"]["num_accepted_tokens_per_pos"]) for r in runs)
    per_pos = [sum((r["spec"]["num_accepted_tokens_per_pos"] + [0] * width)[i] for r in runs) for i in range(width)]
    drafts = tot["num_drafts"]
    return {**tot, "num_accepted_tokens_per_pos": per_pos,
            "rate": tot["num_accepted_tokens"] / tot["num_draft_tokens"] if tot["num_draft_tokens"] else None,
            "rate_per_pos": [x / drafts for x in per_pos] if drafts else [],
            "mean_accepted_per_draft": tot["num_accepted_tokens"] / drafts if drafts else None}


def row_report(part: str, row: str, results: dict) -> dict:
    """Both sides' summaries, the ratio of medians, greedy token equality, and acceptance for spec rows."""
    lo, hi = sides(part)
    a_runs, b_runs = results[(part, row, lo)], results[(part, row, hi)]
    keys = [k for k, v in a_runs[0].items() if isinstance(v, float) and k != "mean_prompt_tokens"]
    rep = {side: {k: summarize([r[k] for r in runs]) for k in keys}
           for side, runs in ((lo, a_runs), (hi, b_runs))}
    rep["ratio"] = rep[hi]["tok_s"]["median"] / rep[lo]["tok_s"]["median"]
    if not (part == "chat" and row.startswith("sampled")):  # sampled outputs are not expected to match
        rep["tokens_differ"] = mismatches(a_runs, b_runs)
    if part != "off":
        rep["acceptance"] = acceptance(b_runs)
        rep["mean_prompt_tokens"] = a_runs[0]["mean_prompt_tokens"]
        rep["output_tokens_per_repeat"] = {lo: a_runs[0]["output_tokens"], hi: b_runs[0]["output_tokens"]}
    return rep


def check_draft(report: dict) -> list[str]:
    """The mechanical check: a draft model identical to the target must have every greedy draft token accepted."""
    row = report.get("draft", {}).get("greedy")
    if row is None:
        return []
    acc = row["acceptance"]
    if acc["num_draft_tokens"] == 0:
        return ["draft: no draft tokens were proposed"]
    if acc["num_accepted_tokens"] != acc["num_draft_tokens"]:
        return [f"draft: greedy acceptance {acc['rate']:.2%} with the target as its own draft, must be 100% "
                f"({acc['num_accepted_tokens']} of {acc['num_draft_tokens']} accepted)"]
    return []


# "Must not cost speed" is read as >= 0.97x: medians of repeats on this host move by a few percent.
TARGETS = {("off", "single_stream"): 0.97, ("off", "offline"): 0.97, ("ngram", "input_grounded"): 2.0,
           ("chat", "greedy"): 0.95, ("chat", "sampled"): 0.95, ("chat", "sampled_unseeded"): 0.95}
LABELS = {("off", "single_stream"): "spec off: single-stream decode tok/s",
          ("off", "offline"): "spec off: offline tok/s",
          ("ngram", "input_grounded"): "ngram: input-grounded, decode tok/s", ("chat", "greedy"): "ngram: chat greedy",
          ("chat", "sampled"): "ngram: chat T={t}, seeded", ("chat", "sampled_unseeded"): "ngram: chat T={t}, no seed",
          ("draft", "greedy"): "draft = target: chat greedy"}


def _cell(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def _table_row(part: str, row: str, rep: dict, temperature: float) -> str:
    lo, hi = sides(part)
    target = TARGETS.get((part, row))
    verdict = "-" if target is None else f">= {target:.2f}x: {'met' if rep['ratio'] >= target else 'NOT met'}"
    acc = rep.get("acceptance", {}).get("rate")
    diff = rep.get("tokens_differ")
    return (f"| {LABELS[(part, row)].format(t=temperature)} | {_cell(rep[lo]['tok_s'])} | {_cell(rep[hi]['tok_s'])} "
            f"| {rep['ratio']:.2f}x | {verdict} | {'-' if acc is None else f'{acc:.1%}'} "
            f"| {'-' if diff is None else '%d of %d' % (diff['differ'], diff['outputs'])} |")


def _overhead_rows(off: dict) -> list[str]:
    o, n = off["single_stream"]["old"], off["single_stream"]["new"]
    delta = n["overhead_ms"]["median"] - o["overhead_ms"]["median"]
    return [f"| spec off: engine overhead per batch-1 decode step, ms (step - forward) | {_cell(o['overhead_ms'])} "
            f"| {_cell(n['overhead_ms'])} | {delta:+.2f} ms | - | - | - |",
            f"| ... of which the LM head (compute_logits), ms | {_cell(o['logits_ms'])} | {_cell(n['logits_ms'])} "
            "| - | - | - | - |"]


def markdown(report: dict, a: argparse.Namespace) -> str:
    """The short table: medians (min-max), ratio vs target, acceptance and greedy token mismatches."""
    lines = [f"Speculative decoding, {report['config']['machine']}, {a.dtype}, {a.threads} threads, "
             f"median of {a.repeats} (min-max)", "",
             "| measurement | old / off | new / on | ratio | target | acceptance | greedy outputs differing |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for part in a.parts:
        lines += [_table_row(part, row, rep, a.temperature) for row, rep in report[part].items()]
        if part == "off":
            lines += _overhead_rows(report["off"])
    return "\n".join(lines) + "\n"


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout.strip()


def baseline_tree(a: argparse.Namespace) -> Path:
    """--baseline-tree as given, or a detached worktree of --baseline-commit in /tmp (reused when already there)."""
    if a.baseline_tree:
        return Path(a.baseline_tree).resolve()
    sha = git(ROOT, "rev-parse", f"{a.baseline_commit}^{{commit}}")  # the repository holding this script
    path = Path(f"/tmp/lmserve-base-{sha[:10]}")
    if not path.exists():
        git(ROOT, "worktree", "add", "--detach", str(path), sha)
    if git(path, "rev-parse", "HEAD") != sha:
        raise SystemExit(f"{path} exists but is not at {sha}; remove it (git worktree remove {path})")
    return path


def describe(tree: Path) -> dict:
    """Where a tree's code comes from: its commit and whether src/ has uncommitted changes (None: not git)."""
    try:
        return {"path": str(tree), "commit": git(tree, "rev-parse", "HEAD"),
                "src_dirty": bool(git(tree, "status", "--porcelain", "--", "src"))}
    except subprocess.CalledProcessError:
        return {"path": str(tree), "commit": None, "src_dirty": None}


def kernel_cache(root: str, tree: Path) -> str:
    """This tree's own LMSERVE_CACHE_DIR under root: kernels built once per tree, never rebuilt by another."""
    return str(Path(root) / "spec_decode" / f"{tree.name}-{hashlib.sha1(str(tree).encode()).hexdigest()[:8]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    ap.add_argument("--tree", type=Path, default=ROOT.parent, help="checkout of the new code (default: this one)")
    base = ap.add_mutually_exclusive_group()
    base.add_argument("--baseline-tree", help="checkout of the old code (part off)")
    base.add_argument("--baseline-commit", help="commit of the old code, checked out into /tmp/lmserve-base-<sha>")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script (not for numbers)")
    for k in FULL:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                        help=f"default {FULL[k]} ({QUICK[k]} with --quick)")
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0, help="sampled chat prompt i uses seed + i")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per engine (several are loaded at once)")
    ap.add_argument("--cache-dir", default=os.environ.get("LMSERVE_CACHE_DIR", str(Path.home() / ".cache" / "lmserve")),
                    help="root of the engines' LMSERVE_CACHE_DIRs (one per tree under <root>/spec_decode/)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/spec_decode.json "
                    "(--quick: benchmarks/.cache/spec_decode_quick.json, git-ignored)")
    a = ap.parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    unknown = set(a.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    a.parts = [p for p in PARTS if p in a.parts.split(",")]
    a.tree = a.tree.resolve()
    if "off" in a.parts and not (a.baseline_tree or a.baseline_commit):
        ap.error("part off needs --baseline-tree or --baseline-commit")
    a.out = a.out or str(ROOT / (".cache/spec_decode_quick.json" if a.quick else "results/spec_decode.json"))
    return a


def run_config(a: argparse.Namespace, trees: dict[str, Path], model_path: str, engines: dict) -> dict:
    """What the report needs to be reproduced: the command, every setting, the machine, trees and engines."""
    return {"command": shlex.join([sys.executable, *sys.argv]),
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "machine": f"{_cpu_name()} ({platform.machine()}; {_flags()})", "cpu_count": os.cpu_count(),
            "model": model_path, "env": {k: v for k, v in os.environ.items() if k.startswith(("LMSERVE_", "OMP_"))},
            "trees": {k: describe(v) for k, v in trees.items()}, "engines": engines}


def main() -> None:
    a = parse_args()
    started = time.perf_counter()
    from lmserve.loader import default_model_path  # this checkout's (compare.py put its src/ first on sys.path)

    trees = {"new": a.tree, **({"old": baseline_tree(a)} if "off" in a.parts else {})}
    model_path = str(default_model_path())
    workers = start_engines(a, trees, model_path)
    engines = {name: {"tree": str(w.tree), **w.info} for name, w in workers.items()}
    results = run_all(a, workers)
    rows = {part: dict.fromkeys(m.row for m in plan(part, a, 0)) for part in a.parts}  # in plan order
    report: dict = {part: {row: row_report(part, row, results) for row in rows[part]} for part in a.parts}
    report["failures"] = check_draft(report)
    report["config"] = {**run_config(a, trees, model_path, engines), "wall_s": time.perf_counter() - started}
    table = markdown(report, a)
    print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    Path(a.out).with_suffix(".md").write_text(table)
    if report["failures"]:
        raise SystemExit("FAILED: " + "; ".join(report["failures"]))


if __name__ == "__main__":
    main()
