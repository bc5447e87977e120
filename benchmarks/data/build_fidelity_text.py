"""Builds fidelity_text.txt (the fixed text of benchmarks/perplexity.py) from Python standard-library docstrings.

    python benchmarks/data/build_fidelity_text.py [--out benchmarks/data/fidelity_text.txt]

Run once (CPython 3.11.7); the output is committed, so a later Python whose docstrings differ changes
nothing unless this is rerun. The docstrings are part of CPython, distributed under the PSF License
Agreement, which allows redistribution with its copyright notice (benchmarks/data/README.md).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

# (module, attribute holding the text): prose first, then documentation with code examples
SOURCES = (("heapq", "__about__"), ("turtle", "__doc__"), ("cmd", "__doc__"), ("pydoc", "__doc__"),
           ("unittest", "__doc__"), ("doctest", "__doc__"), ("difflib", "__doc__"), ("inspect", "__doc__"),
           ("subprocess", "__doc__"))


def build() -> str:
    """The sections, each headed by where it came from, separated by blank lines."""
    parts = []
    for module, attr in SOURCES:
        text = inspect.cleandoc(getattr(importlib.import_module(module), attr))
        parts.append(f"From Python's {module} module:\n\n{text}\n")
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("fidelity_text.txt")))
    args = ap.parse_args()
    Path(args.out).write_text(build())
    print(f"wrote {args.out} with CPython {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
