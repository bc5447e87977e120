"""Imports follow a graph: each package lists what it may import (MAY_IMPORT), and no modules import in a cycle.

The graph is a DAG, not a total order: siblings do not see each other unless an edge says so (the scheduler
never imports the worker, the KV cache never imports the sampler), and the test checks the graph itself has no
cycle. Nodes are the top-level packages and modules of `src/lmserve` (ARCHITECTURE.md draws them), plus
two modules placed apart:

- `sched.output` is contract 1's plain data (SchedulerOutput: what runs how many tokens, no tensors), the
  message the scheduler hands the worker; the worker may import it and nothing else of `sched`.
- `engine.serving` is the engine as the server sees it (AsyncEngine, EngineFront, what their listeners get,
  how an engine is opened); `server/` may import it and nothing else of `engine`.
- `lmserve` (the package root) is the public facade: it imports SamplingParams eagerly and `LLM` lazily.

Every import counts: module level, inside functions (the CLI imports lazily) and under TYPE_CHECKING, both for
the allowed edges and for cycles between modules (a lazy import in a cycle still ties the two modules together).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Plain data and helpers that every node may import; they import only each other (no cycle among them either).
# beam_search: the search state over one prompt, no I/O (as vLLM's top-level vllm/beam_search.py); the offline LLM
# and the server's completions route both drive it.
PLAIN = frozenset({"config", "request", "sampling_params", "pooling_params", "utils", "units", "files", "cpu_dtype",
                   "errors", "beam_search"})

MAY_IMPORT: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    "deploy": {"cli", "server.app", "server"},  # each Ray Serve replica parses `lmserve serve` flags and runs the server's app
    # lmserve: `lmserve --version` reads the facade's __version__ (cli/__init__.py; flags.py and hub.py are cli too)
    "cli": {"lmserve", "bench", "server.app", "server.batch", "ops", "engine", "preflight", "tokenizer", "loader", "lora",
            "parsers", "multimodal"},  # parsers: the --reasoning-parser / --tool-call-parser names
    "bench": {"engine", "preflight", "loader", "models", "layers"},  # `lmserve bench`: cli only registers its parser
    # server/ by concern: app.py, main.py and start.py assemble the app (server.app); each API family in server/api/ only
    # translates its shapes onto the shared middle (server: admission, streaming, errors, auth, metrics, state);
    # server/batch/ runs lines through the OpenAI API's handling; server/models/ is the pool of served models.
    "server.app": {"server", "server.api", "server.batch", "server.playground", "server.models", "lmserve", "ops"},
    "server.batch": {"server", "server.api", "ops"},
    "server.api": {"server", "server.playground", "lmserve", "ops", "tokenizer", "lora", "structured",
                   "parsers", "multimodal"},
    "server.playground": {"server"},  # api/openapi.py (above) documents the playground's share routes
    # structured: a compiled grammar's type; loader: the response cache fingerprints the weights
    "server": {"server.models", "ops", "engine.serving", "lora", "loader", "structured", "multimodal"},
    # flags checked as the CLI checks them; hub names resolved; the engine type of a loaded model
    "server.models": {"preflight", "loader", "engine.serving"},
    "ops": set(),  # observability reads engine data handed to it; the engine never knows it exists
    "lmserve": {"engine"},  # the facade's lazy `from lmserve import LLM`
    "engine.serving": {"engine"},  # the seam: what server/ may know of the engine (engine/serving.py)
    "engine": {"sched", "sched.output", "cache", "worker", "spec", "structured", "lora", "loader", "tokenizer",
               "preflight", "layers", "multimodal"},  # layers: engine/build.py picks the attention backend the runner uses
    "preflight": {"cache", "worker", "lora", "loader", "models", "layers", "tokenizer"},  # checks before a load
    "sched": {"sched.output", "cache", "structured"},
    "sched.output": set(),
    "cache": set(),
    # worker/transforms.py, the model's one transform pipeline, is worker's: it applies layers' weight formats, wrappers
    # and kernels and lora's slots to what loader built, and the engine, a TP rank and a draft run it
    "worker": {"sched.output", "sample", "lora", "loader", "models", "layers", "multimodal"},
    "sample": {"structured", "layers"},  # layers: the native kernels (greedy argmax with its logprob)
    "spec": set(),
    # images decoded and checked (image_io.py) and each vision family's preprocessing: plain data and Pillow, no I/O
    "multimodal": set(),
    "structured": set(),
    "parsers": {"structured"},  # text -> reasoning, content, tool calls; each tool format's grammar (a structural tag)
    "lora": {"loader", "models", "layers"},
    "tokenizer": {"loader"},  # a GGUF's vocabulary is read from its metadata
    "loader": {"models", "layers"},
    "models": {"layers"},
    "layers": set(),
    **{name: set() for name in PLAIN},
}.items()}
BY_MODULE = {"lmserve.sched.output": "sched.output", "lmserve.engine.serving": "engine.serving",
             "lmserve.server.app": "server.app", "lmserve.server.main": "server.app",
             "lmserve.server.start": "server.app", "lmserve.server.gate": "server.app",
             **{f"lmserve.server.{sub}": f"server.{sub}" for sub in ("api", "batch", "playground", "models")}}


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module name."""

    importer: str
    target: str
    line: int


def node_of(module: str) -> str:
    """The graph node a module belongs to; a module of a package the graph does not name fails the test."""
    for name in (module, *_parents(module)):
        if name in BY_MODULE:
            return BY_MODULE[name]
    top = "lmserve" if module == "lmserve" else module.split(".")[1]
    if top not in MAY_IMPORT:
        raise AssertionError(f"{module} belongs to no node: add {top!r} to MAY_IMPORT in {__file__}")
    return top


def may_import(importer: str, target: str) -> bool:
    a, b = node_of(importer), node_of(target)
    return a == b or b in PLAIN or b in MAY_IMPORT[a]


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


def forbidden(imports: list[Import]) -> list[Import]:
    """The imports the graph does not allow."""
    return [i for i in imports if not may_import(i.importer, i.target)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def module_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.importer != i.target:
            graph.setdefault(i.importer, set()).add(i.target)
    return graph


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


def test_every_import_follows_the_graph():
    bad = forbidden(all_imports())
    assert not bad, "imports the graph (MAY_IMPORT) does not allow:\n" + "\n".join(
        f"  {i.importer} (line {i.line}) imports {i.target}" for i in bad)


def test_no_modules_import_each_other_in_a_cycle():
    found = cycles(module_graph(all_imports()))
    assert not found, "module import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_the_graph_is_a_dag():
    edges = {a: set(b) | (set() if a in PLAIN else set(PLAIN)) for a, b in MAY_IMPORT.items()}
    assert not cycles(edges)
    assert all(b in MAY_IMPORT for targets in MAY_IMPORT.values() for b in targets)  # no dead names


def test_every_module_has_a_node():
    for name in source_modules():
        node_of(name)


def test_the_runner_sees_only_the_schedulers_output():
    sched = {i.target for i in all_imports() if node_of(i.importer) == "worker" and i.target.startswith("lmserve.sched")}
    assert sched <= {"lmserve.sched.output"}, sched


# Server code reaching into the engine (issue 29's count): `.engine.<attr>` other than `.engine.generate` /
# `.engine.abort`, and `.scheduler.`, anywhere in server/'s source, as `grep` finds them. Routes hold the front end
# (engine/front.EngineFront, through the seam engine/serving.py), never the engine's parts. The 3 today: the two
# imports of engine/serving.py (server/state.py, server/models/pool.py) and the read of a model's configured batch
# size while it is not loaded (`spec.config.scheduler.max_num_seqs`, server/state.py).
ENGINE_REACH = re.compile(r"\.engine\.(?!(?:generate|abort)\b)[A-Za-z_]\w*|\.scheduler\.")
MAX_ENGINE_REACHES = 3


def engine_reaches(root: Path) -> list[str]:
    """Every occurrence of ENGINE_REACH in the .py files under `root`, as `path:line: text`."""
    return [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in sorted(root.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) for _ in ENGINE_REACH.finditer(line)]


def test_server_code_reaches_into_the_engine_at_most_three_times():
    found = engine_reaches(SRC / "lmserve" / "server")
    assert len(found) <= MAX_ENGINE_REACHES, "server code reaching into the engine (hold the front end instead):\n" \
        + "\n".join("  " + f for f in found)


def test_the_reach_count_sees_what_grep_sees(tmp_path):
    (tmp_path / "a.py").write_text("x = st.engine.tokenizer\nst.engine.generate(1); st.engine.abort(2)\n"
                                   "from lmserve.engine.front import EngineFront\nn = e.scheduler.running  # .engine.x\n")
    assert [f.split(":")[1] for f in engine_reaches(tmp_path)] == ["1", "3", "4", "4"]


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor in an acyclic import graph: 0 when it imports nothing, else 1 + its highest import's."""
    floor: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in floor:
            floor[node] = 1 + max((of(t) for t in edges.get(node, ()) if t != node), default=-1)
        return floor[node]

    for node in edges:
        of(node)
    return floor


def condensed(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """`edges` with each cycle merged into one node (its first module), so that floors exist for any graph."""
    first = {m: c[0] for c in cycles(edges) for m in c}
    out: dict[str, set[str]] = {}
    for a, targets in edges.items():
        node = first.get(a, a)
        out.setdefault(node, set()).update(first.get(b, b) for b in targets if first.get(b, b) != node)
    return out


def test_floors_of_a_small_graph():
    assert floors({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == {"a": 2, "b": 1, "c": 0}
    assert floors(condensed({"a": {"b"}, "b": {"a", "c"}, "c": set()})) == {"a": 1, "c": 0}


# -- the checker itself must be able to fail --------------------------------------------------------

KNOWN = {"lmserve.models.config", "lmserve.layers.kernels.fused", "lmserve.layers.blocks.rotary", "lmserve.server",
         "lmserve.server.app", "lmserve.cli", "lmserve.sched.output", "lmserve.sched.scheduler",
         "lmserve.worker.model_runner", "lmserve.sample.sampler", "lmserve.engine.llm_engine",
         "lmserve.engine.serving"}


def _flagged(module: str, source: str, is_package: bool = False) -> list[str]:
    return [i.target for i in forbidden(imports_of(module, source, is_package, KNOWN))]


@pytest.mark.parametrize("module,source,target", [
    ("lmserve.layers.blocks.rotary", "from lmserve.models.config import ModelConfig", "lmserve.models.config"),
    ("lmserve.server.main", "def f():\n    from lmserve.cli import engine_config", "lmserve.cli"),
    ("lmserve.layers.blocks.rotary", "import lmserve.models.config", "lmserve.models.config"),
    ("lmserve.layers.blocks.rotary", "from ...models import config", "lmserve.models.config"),
    ("lmserve.request", "from lmserve import server", "lmserve.server"),
    ("lmserve.sched.output", "from lmserve.sched.scheduler import Scheduler", "lmserve.sched.scheduler"),
    # siblings the graph keeps apart (a total order of tiers let these pass)
    ("lmserve.sched.scheduler", "from lmserve.worker.model_runner import ModelRunner", "lmserve.worker.model_runner"),
    ("lmserve.cache.block_pool", "from lmserve.sample.sampler import Sampler", "lmserve.sample.sampler"),
    ("lmserve.worker.inputs", "from lmserve.sched.scheduler import Scheduler", "lmserve.sched.scheduler"),
    # the server sees the engine only through its seam, engine/serving.py
    ("lmserve.server.state", "from lmserve.engine.llm_engine import LLMEngine", "lmserve.engine.llm_engine"),
    ("lmserve.server.api.openai", "from lmserve.engine.serving import EngineFront", "lmserve.engine.serving"),
])
def test_checker_flags_an_import_the_graph_forbids(module, source, target):
    assert _flagged(module, source) == [target]


@pytest.mark.parametrize("module,source", [
    ("lmserve.models.llama", "from lmserve.layers.blocks.rotary import cos_sin"),  # down
    ("lmserve.layers.kernels.fused", "from lmserve.layers.blocks.rotary import apply_rotary"),  # same package
    ("lmserve.layers.kernels.fused", "from . import rotary"),
    ("lmserve.layers.formats.linear", "from lmserve.utils import cpu_has_fast_bf16"),  # plain data
    ("lmserve.worker.inputs", "from lmserve.sched.output import ScheduledRequest"),  # plain data by module
    ("lmserve.server.api.tgi", "import lmserve"),
    ("lmserve.server.state", "from lmserve.engine.serving import AsyncEngine"),  # the middle holds the engine
    ("lmserve.cli", "import argparse\nfrom torch import nn"),  # not ours
])
def test_checker_passes_allowed_imports(module, source):
    assert _flagged(module, source) == []


def test_a_package_without_a_node_fails():
    with pytest.raises(AssertionError, match="belongs to no node"):
        node_of("lmserve.newthing.x")


def test_cycle_finder_sees_a_cycle_through_several_modules():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def numbers() -> list[str]:
    """The house's floors and cycles as this test sees them (`python tests/test_layering.py [SRC]`: another tree's)."""
    modules = module_graph(all_imports())
    node_floor = floors({a: set(b) | (set() if a in PLAIN else set(PLAIN)) for a, b in MAY_IMPORT.items()})
    server = {m: {t for t in ts if t.startswith("lmserve.server")} for m, ts in modules.items()
              if m.startswith("lmserve.server")}
    return [f"this file's graph: {len(MAY_IMPORT)} nodes, {max(node_floor.values()) + 1} tiers "
            f"(longest path: {max(node_floor.values())} edges)",
            f"modules: {len(source_modules())}; module cycles: {len(cycles(modules))} {cycles(modules)}",
            f"module import floors: {max(floors(condensed(modules)).values()) + 1}; "
            f"server/ module floors: {max(floors(condensed(server)).values()) + 1}",
            f"server code reaching into the engine: {len(engine_reaches(SRC / 'lmserve' / 'server'))}"]


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        SRC = Path(sys.argv[1]).resolve()
    print("\n".join(numbers()))
