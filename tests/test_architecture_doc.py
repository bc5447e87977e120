"""ARCHITECTURE.md stays a map a newcomer reads in ten minutes, and it and docs/internals.md name only what exists.

Checked: every path either names (`src/...`, `tests/...`, `benchmarks/...`, `docs/...`, `deploy/...`, and every
`x.py`, `pkg/x.py`, `x.cpp`, `x.h`, `x.md` mention, found under the repository root, under src/lmserve/, or as the
tail of a file's path); the map and request path before the first recipe fit in 120 lines; the import graph the map
draws is tests/test_layering.py's MAY_IMPORT, edge for edge.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_layering import MAY_IMPORT, PLAIN

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("ARCHITECTURE.md", "docs/internals.md")
MAP_LINES = 120
RECIPES = ("model family", "API dialect", "sampler parameter", "kernel", "weight format", "model transform")

# `src/lmserve/layers/`, `benchmarks/results/gpu.json`: a path from the root (extension or not)
ROOTED = re.compile(r"(?<![\w/.<>-])((?:src|tests|benchmarks|docs|deploy)/[\w./-]*[\w/])")
# `served.py`, `server/models/pool.py`, `csrc/thread_pool.h`: a file named by its tail (a `<family>.py` template is
# no name: the look-behind refuses a match that starts inside one)
NAMED = re.compile(r"(?<![\w/.<>-])((?:[\w-]+/)*[\w-]+\.(?:py|cpp|h|md))\b")
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules"}
NOT_PATHS = {"llama.cpp"}  # a project's name


def named_paths(text: str) -> set[str]:
    """Every path or file name a document mentions (a template such as `<family>.py` is none)."""
    return ({m.rstrip(".") for m in ROOTED.findall(text)} | set(NAMED.findall(text))) - NOT_PATHS


def repo_files(root: Path) -> list[str]:
    """Every file and folder under root, as posix paths relative to it, outside virtualenvs and caches."""
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if not SKIP_DIRS.intersection(rel.parts):
            out.append(rel.as_posix())
    return out


def exists(name: str, root: Path, files: list[str]) -> bool:
    """A path from the root or from src/lmserve, or the tail of some file's path (`tenants.py`, `csrc/ops.h`); a
    `pkg/module.name` (deploy/forward.run_asgi) is a module that defines that name."""
    bare = name.rstrip("/")
    head, _, attr = bare.rpartition(".")
    if attr and "/" in head and attr not in ("py", "cpp", "h", "md", "json", "sh"):
        return any(re.search(rf"^\s*(?:def|class|async def) {re.escape(attr)}\b|^{re.escape(attr)}\b",
                             (root / "src" / "lmserve" / f).read_text(), re.M)
                   for f in (head + ".py",) if (root / "src" / "lmserve" / f).exists())
    if (root / bare).exists() or (root / "src" / "lmserve" / bare).exists():
        return True
    return any(f.endswith("/" + bare) for f in files)


def missing(text: str, root: Path) -> list[str]:
    files = repo_files(root)
    return sorted(n for n in named_paths(text) if not exists(n, root, files))


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_doc_names_exists(doc):
    gone = missing((ROOT / doc).read_text(), ROOT)
    assert not gone, f"{doc} names paths that do not exist: {gone}"


def test_map_and_request_path_fit_on_one_page():
    lines = (ROOT / "ARCHITECTURE.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("## Recipe"))
    assert first <= MAP_LINES, f"{first} lines before the first recipe (at most {MAP_LINES})"


def test_every_recipe_is_there():
    headings = [line for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines() if line.startswith("## Recipe")]
    for topic in RECIPES:
        assert any(topic in h for h in headings), f"no recipe for: {topic}"


def drawn_graph(text: str) -> tuple[dict[str, set[str]], set[str]]:
    """The import graph ARCHITECTURE.md draws (`node ─► a, b` lines; `x, y: import nothing ...`) and its plain modules."""
    graph: dict[str, set[str]] = {}
    for line in text.splitlines():
        if "─►" in line:
            node, targets = line.split("─►")
            graph[node.strip()] = {t.strip() for t in targets.split(",")}
        elif (m := re.match(r"^([\w., ]+): import nothing", line)):
            graph.update({n.strip(): set() for n in m.group(1).split(",")})
    plain = re.search(r"the plain modules \(([^)]*)\)", text)
    return graph, {p.strip() for p in plain.group(1).split(",")} if plain else set()


def test_the_drawn_import_graph_is_the_checked_one():
    graph, plain = drawn_graph((ROOT / "ARCHITECTURE.md").read_text())
    checked = {k: set(v) for k, v in MAY_IMPORT.items() if k not in PLAIN}
    assert graph == checked
    assert plain == set(PLAIN)


# -- the checks themselves must be able to fail ----------------------------------------------------------------------

def test_a_missing_path_is_reported(tmp_path):
    (tmp_path / "src" / "lmserve" / "server").mkdir(parents=True)
    (tmp_path / "src" / "lmserve" / "models").mkdir()
    (tmp_path / "src" / "lmserve" / "server" / "served.py").write_text("")
    (tmp_path / "tests").mkdir()
    text = ("`server/served.py`, served.py, src/lmserve/server/, `gone.py`, tests/test_gone.py, "
            "src/lmserve/models/<family>.py, <dialect>_protocol.py, `lmserve/served.cpp`, llama.cpp, "
            "deploy/forward.run_asgi, deploy/forward.gone.")
    (tmp_path / "src" / "lmserve" / "deploy").mkdir()
    (tmp_path / "src" / "lmserve" / "deploy" / "forward.py").write_text("def run_asgi():\n    pass\n")
    assert missing(text, tmp_path) == ["deploy/forward.gone", "gone.py", "lmserve/served.cpp", "tests/test_gone.py"]


def test_a_drawn_graph_that_differs_is_seen():
    text = ("the plain modules (config, utils)\n```\nserver ─► engine.serving, ops\n"
            "cache, layers: import nothing of lmserve\n```\n")
    graph, plain = drawn_graph(text)
    assert graph == {"server": {"engine.serving", "ops"}, "cache": set(), "layers": set()}
    assert plain == {"config", "utils"}
    assert graph != {k: set(v) for k, v in MAY_IMPORT.items() if k not in PLAIN}
