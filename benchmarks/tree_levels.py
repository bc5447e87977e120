"""One child process per (source tree, native kernel level): the A/B harness of step_levels.py and decode_attention.py.

Each child runs `script --child ...` with LMSERVE_NATIVE_LEVEL=level (a lower level runs on any newer CPU) and
PYTHONPATH=tree, so it loads that tree's own kernel build, and prints one JSON line holding at least "lmserve" (the
package file it imported, checked against the tree). Within a round the levels alternate; the trees' order flips
every round, so a neighbour's load and any warm-up lands on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_tree_args(ap: argparse.ArgumentParser, levels: str) -> None:
    """The options every such benchmark takes: levels, threads, trees, rounds, out, and the hidden --child."""
    ap.add_argument("--levels", default=levels)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trees", default=f"this={ROOT / 'src'}", help="name=src-dir,... (compare two checkouts)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def runnable(levels: str) -> tuple[list[str], list[str]]:
    """(the levels this CPU runs, the ones it lacks) of a comma-separated list."""
    from lmserve.layers.kernels.native import pick_level
    from lmserve.utils import cpu_flags

    ok, skipped = [], []
    for level in levels.split(","):
        try:
            pick_level(cpu_flags(), level)
            ok.append(level)
        except ValueError:
            skipped.append(level)
    return ok, skipped


def run_children(script: str, child_args: list[str], trees: dict[str, str], levels: list[str],
                 rounds: int) -> dict[tuple[str, str], list[dict]]:
    """(tree, level) -> each round's child JSON."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(rounds):
        for level in levels:
            for tree, src in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
                env = dict(os.environ, LMSERVE_NATIVE_LEVEL=level, PYTHONPATH=src)
                res = subprocess.run([sys.executable, script, "--child", *child_args], env=env, capture_output=True,
                                     text=True)
                if res.returncode:
                    sys.exit(f"{tree} {level} failed:\n{res.stderr[-3000:]}")
                run = json.loads(res.stdout.strip().splitlines()[-1])
                if not Path(run["lmserve"]).resolve().is_relative_to(Path(src).resolve()):
                    sys.exit(f"{tree}: the child imported {run['lmserve']}, not {src}")
                runs.setdefault((tree, level), []).append(run)
    return runs
