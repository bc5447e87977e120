"""Imports only go down STYLE.md's list of layers; this test parses every module and keeps it so.

Layers, top to bottom (a module may import its own layer and any layer below it):

    deploy                   lmserve on platforms that run many replicas (Ray Serve): each replica parses
                             `lmserve serve` flags with the CLI's parser and runs the server's app
    cli                      the `lmserve` command
    bench                    `lmserve bench`: a top-level tool like cli; cli only registers its parser
                             (cli imports bench.cli), and bench drives engines or a server over HTTP
    server                   the FastAPI app
    ops                      server-side observability (tracing, payload log, rules, drift): server and
                             cli import it, it imports nothing of ours but itself, so it sits just
                             under server; it may read engine data, and engine must not know it exists
    engine
    sched
    cache
    worker
    sample
    spec, structured, lora   features behind one seam each
    loader
    models
    layers, quant
    config, request, sampling_params, utils, cpu_dtype, errors   plain data and helpers everyone may import

Placed by module rather than by package:
- `lmserve.sched.output` is contract 1's plain data (SchedulerOutput: what runs how many tokens,
  no tensors), the message the scheduler hands the worker, so it sits with the plain-data modules;
  the worker reads it without importing the scheduler, and this test keeps it plain.
- `lmserve` (the package root) eagerly imports only SamplingParams and holds `__version__`, and it
  runs before any lmserve module anyway, so importing it is like importing plain data. Its lazy
  `LLM` re-export is the public facade, allowed by name in ALLOWED below.

Every import counts: module level, inside functions (the CLI imports lazily) and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("deploy",),
    ("cli",),
    ("bench",),
    ("server",),
    ("ops",),
    ("engine",),
    ("sched",),
    ("cache",),
    ("worker",),
    ("sample",),
    ("spec", "structured", "lora"),
    ("loader",),
    ("models",),
    ("layers", "quant"),
    ("config", "request", "sampling_params", "utils", "cpu_dtype", "errors"),
)
PLAIN_DATA = len(LAYERS) - 1
BY_MODULE = {"lmserve": PLAIN_DATA, "lmserve.sched.output": PLAIN_DATA}

# (importer, imported): why this upward import is right.
ALLOWED = {
    ("lmserve", "lmserve.engine.llm"): "the package root re-exports LLM lazily: `from lmserve import LLM`",
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module name."""

    importer: str
    target: str
    line: int


def layer_of(module: str) -> int:
    """Index into LAYERS (0 is the top); a module of a package no layer names fails the test."""
    for name in (module, *_parents(module)):
        if name in BY_MODULE:
            return BY_MODULE[name]
    top = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} belongs to no layer: add {top!r} to LAYERS in {__file__}")


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 1, -1)]


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every lmserve import in `source`, wherever it sits in the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.module, node.level)
            for a in node.names:  # `from lmserve.server import app` imports the module lmserve.server.app
                sub = f"{base}.{a.name}"
                found.append(Import(module, sub if sub in known else base, node.lineno))
    ours = [i for i in found if i.target == "lmserve" or i.target.startswith("lmserve.")]
    return list(dict.fromkeys(ours))  # `from m import a, b` is one import of m


def _absolute(module: str, is_package: bool, name: str | None, level: int) -> str:
    """`from ..x import y` seen from `module` -> the absolute name of `..x`."""
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def upward(imports: list[Import]) -> list[Import]:
    """The imports that go up the list and are not in ALLOWED."""
    return [i for i in imports
            if layer_of(i.target) < layer_of(i.importer) and (i.importer, i.target) not in ALLOWED]


def source_modules() -> dict[str, tuple[Path, bool]]:
    """Every module under src/lmserve: its name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in sorted((SRC / "lmserve").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def all_imports() -> list[Import]:
    modules = source_modules()
    known = set(modules)
    return [i for name, (path, is_package) in modules.items()
            for i in imports_of(name, path.read_text(), is_package, known)]


def test_no_import_goes_up_the_layers():
    bad = upward(all_imports())
    assert not bad, "imports that go up STYLE.md's layers:\n" + "\n".join(
        f"  {i.importer} (line {i.line}) imports {i.target}" for i in bad)


def test_every_allowed_upward_import_still_exists():
    edges = {(i.importer, i.target) for i in all_imports()}
    assert set(ALLOWED) <= edges, f"stale ALLOWED entries: {set(ALLOWED) - edges}"


def test_every_module_has_a_layer():
    for name in source_modules():
        layer_of(name)


# -- the checker itself must be able to fail --------------------------------------------------------

KNOWN = {"lmserve.models.config", "lmserve.layers.fused", "lmserve.layers.rotary", "lmserve.server",
         "lmserve.server.app", "lmserve.cli", "lmserve.sched.output", "lmserve.sched.scheduler"}


def _flagged(module: str, source: str, is_package: bool = False) -> list[str]:
    return [i.target for i in upward(imports_of(module, source, is_package, KNOWN))]


@pytest.mark.parametrize("module,source,target", [
    ("lmserve.layers.rotary", "from lmserve.models.config import ModelConfig", "lmserve.models.config"),
    ("lmserve.server.main", "def f():\n    from lmserve.cli import engine_config", "lmserve.cli"),
    ("lmserve.layers.rotary", "import lmserve.models.config", "lmserve.models.config"),
    ("lmserve.layers.rotary", "from ..models import config", "lmserve.models.config"),
    ("lmserve.request", "from lmserve import server", "lmserve.server"),
    ("lmserve.sched.output", "from lmserve.sched.scheduler import Scheduler", "lmserve.sched.scheduler"),
])
def test_checker_flags_a_synthetic_upward_import(module, source, target):
    assert _flagged(module, source) == [target]


@pytest.mark.parametrize("module,source", [
    ("lmserve.models.llama", "from lmserve.layers.rotary import cos_sin"),  # down
    ("lmserve.layers.fused", "from lmserve.layers.rotary import apply_rotary"),  # same layer
    ("lmserve.layers.fused", "from . import rotary"),
    ("lmserve.layers.linear", "from lmserve.utils import cpu_has_fast_bf16"),  # plain data
    ("lmserve.worker.inputs", "from lmserve.sched.output import ScheduledRequest"),  # plain data by module
    ("lmserve.server.tgi_routes", "import lmserve"),
    ("lmserve.cli", "import argparse\nfrom torch import nn"),  # not ours
])
def test_checker_passes_downward_and_sideways_imports(module, source):
    assert _flagged(module, source) == []


def test_a_package_without_a_layer_fails():
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("lmserve.newthing.x")
