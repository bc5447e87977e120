"""Code lines per package of src/lmserve, as issue 29 counts them: lines that are neither blank nor a comment
(docstrings count). Modules directly in src/lmserve are one row, "(top level)".

    python benchmarks/code_lines.py src/lmserve /tmp/base/src/lmserve   # one column per tree, first is "now"
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path


def code_lines(text: str) -> int:
    """Lines that are neither blank nor a comment."""
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def per_package(root: Path) -> Counter:
    """Code lines of every package under `root` (a package's subpackages count toward it)."""
    counts: Counter = Counter()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        counts[parts[0] if len(parts) > 1 else "(top level)"] += code_lines(path.read_text())
    return counts


def table(roots: list[Path]) -> str:
    """A markdown table: one row per package, one column per tree, and the total."""
    counts = [per_package(r) for r in roots]
    names = sorted(set().union(*counts), key=lambda n: (n == "(top level)", n))
    rows = ["| package | " + " | ".join(str(r) for r in roots) + " |", "|---" * (len(roots) + 1) + "|"]
    rows += [f"| {n} | " + " | ".join(f"{c[n]:,}" if n in c else "-" for c in counts) + " |" for n in names]
    rows.append("| **total** | " + " | ".join(f"**{sum(c.values()):,}**" for c in counts) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table([Path(a) for a in sys.argv[1:]] or [Path(__file__).resolve().parents[1] / "src" / "lmserve"]))
