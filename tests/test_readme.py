"""Every command in README.md and in the docs/ pages it links runs here, so none of them can go stale.

- Fenced ```bash blocks run for real from the repository root, with `.venv/bin` (this interpreter's
  bin) first on PATH. An `lmserve serve` command starts on a free port instead of 8000, must answer
  /health 200, and must exit 0 on SIGTERM. The README's HTTP examples (curl, and python with an official client)
  run against the first one.
- Fenced ```python blocks run for real; consecutive python blocks of one section run as one script,
  as a reader pastes them one after the other; a block that makes an official client (CLIENTS: openai,
  anthropic) runs against the quick-start server instead. ```json blocks must parse.
- Inline `lmserve ...` commands are parsed by lmserve's own argument parser (flags and values
  checked without running minutes of work); inline `python benchmarks/X.py ...` commands may only
  name flags the script's --help lists (running a benchmark takes minutes to hours: that is what the
  benchmarks are for).
- Placeholders a reader replaces (`path/to/model.gguf`) become the embedded model's file, and
  `path/to/adapter` a random PEFT LoRA adapter for it (tests/lora_adapters.py). Hub ids
  resolve offline (HF_HUB_OFFLINE=1) from a Hugging Face cache this test writes: a tiny random
  checkpoint under the README's id, since nothing may be downloaded here.
- A block preceded by `<!-- not run by tests/test_readme.py: why -->` is skipped; there may be at
  most MAX_NOT_RUN of them, so skipping cannot quietly become the rule.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lmserve.loader import read_model_config
from tests.conftest import write_hub_snapshot
from tests.encoder_models import build_encoder, minilm_dir
from tests.lora_adapters import write_random_adapter
from tests.server_util import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README first: its quick-start server answers every page's HTTP examples.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
QUICK_START_LINES = 40
MAX_NOT_RUN = 1
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
SERVE = re.compile(r"(^|[\s/])lmserve serve\b")
# Words the README's prose uses for what a reader fills in.
PLACEHOLDERS = {"PROMPT": "hello", "JSON": '{"method": "ngram"}', "URL": "http://127.0.0.1:8000"}
NOT_RUN = re.compile(r"<!-- not run by tests/test_readme.py: (.+?) -->\s*$")
# A python block that makes one of these official clients talks to the quick-start server (the others run offline).
CLIENTS = ("OpenAI(", "Anthropic(")


@dataclass
class Block:
    lang: str
    text: str
    section: str
    line: int
    not_run: str | None  # the reason given in the README, or None
    page: str = "README"  # README, or the docs/ page's name


def page_blocks() -> list[Block]:
    """Every page's blocks, README first, each page in order."""
    return [b for page in PAGES for b in readme_blocks(page.read_text(), page.stem)]


def pages_text() -> str:
    return "\n\n".join(page.read_text() for page in PAGES)


def readme_blocks(text: str, page: str = "README") -> list[Block]:
    """Fenced code blocks with their language, section heading and line number."""
    blocks, section, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        line = lines[i].strip()  # a block inside a list item is indented
        if lines[i].startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("```") and len(line) > 3:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            reason = NOT_RUN.search(lines[i - 1]) if i else None
            blocks.append(Block(line[3:].strip(), textwrap.dedent("\n".join(lines[i + 1:end])), section, i + 1,
                                reason.group(1) if reason else None, page))
            i = end
        i += 1
    return blocks


def is_client(block: Block) -> bool:
    """A python block that talks to the quick-start server: an official client, or any client given its URL."""
    return any(c in block.text for c in CLIENTS) or "127.0.0.1:8000" in block.text


def commands(block: Block) -> list[str]:
    """A bash block's commands, one per logical line (backslash continuations joined, blank lines dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    lines = [re.sub(r"\s{2,}# .*$", "", c) for c in joined.splitlines()]  # a trailing "  # comment"
    return [c for c in lines if c.strip() and not c.lstrip().startswith("#")]


def inline_commands(text: str, prefix: str) -> list[str]:
    """Inline `code` spans outside fenced blocks that start with `prefix`."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [m for m in re.findall(r"`([^`\n]+)`", prose.replace("\n", " ")) if m.startswith(prefix)]


def argv_of(command: str) -> list[str]:
    """shlex words up to a redirection or pipe."""
    words = shlex.split(command)
    cut = next((i for i, w in enumerate(words) if w in (">", "|", "&&", "2>")), len(words))
    return words[:cut]


# ---------------------------------------------------------------- the environment the commands run in


@pytest.fixture(scope="module")
def env(tmp_path_factory, smol_path):
    """PATH with the venv first, an offline Hub cache holding the README's Hub id, and the substitutions."""
    cache = tmp_path_factory.mktemp("hub")
    write_hub_snapshot(cache, HUB_ID, SNAPSHOT)
    adapter = write_random_adapter(tmp_path_factory.mktemp("lora") / "adapter", read_model_config(smol_path))
    # the retrieval set-up: the real all-MiniLM-L6-v2 (from its PyPI package) and a tiny random BERT cross-encoder
    cross = build_encoder(tmp_path_factory.mktemp("cross"), num_labels=1, pooling=None)
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"], "HF_HUB_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "LMSERVE_TEST_SMOL": str(smol_path),
            "LMSERVE_TEST_ADAPTER": str(adapter), "LMSERVE_TEST_MINILM": str(minilm_dir()),
            "LMSERVE_TEST_CROSS": str(cross),
            "XDG_DATA_HOME": str(tmp_path_factory.mktemp("data"))}  # batch jobs' default --batch-dir


def substitute(text: str, env: dict, port: int | None = None) -> str:
    text = text.replace("path/to/model.gguf", env["LMSERVE_TEST_SMOL"]).replace(
        "path/to/draft.gguf", env["LMSERVE_TEST_SMOL"]).replace("path/to/adapter", env["LMSERVE_TEST_ADAPTER"])
    text = text.replace("path/to/all-MiniLM-L6-v2", env["LMSERVE_TEST_MINILM"]).replace(
        "path/to/a-cross-encoder", env["LMSERVE_TEST_CROSS"]).replace("path/to/chat.gguf", env["LMSERVE_TEST_SMOL"])
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}") if port else text


class Serve:
    """One README `lmserve serve` command, started on a free port."""

    def __init__(self, command: str, env: dict) -> None:
        self.port = free_port()
        self.log = open(os.devnull, "wb")
        self.proc = subprocess.Popen(["bash", "-c", f"exec {command} --port {self.port}"], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.command = command

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"`{self.command}` exited {self.proc.returncode}:\n"
                                     + self.proc.stdout.read().decode(errors="replace")[-3000:])
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"`{self.command}` never became healthy")

    def stop(self) -> None:
        """SIGTERM must drain and exit 0 (the README says so)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"`{self.command}` did not stop on SIGTERM") from None
        assert code == 0, f"`{self.command}` exited {code} on SIGTERM"


def run(command: str, env: dict, port: int | None = None, timeout: float = 600) -> str:
    """A non-serving README command; it must exit 0. Its stdin is a line a chat user would type."""
    r = subprocess.run(["bash", "-c", substitute(command, env, port)], cwd=ROOT, env=env, input="Say hi.\n",
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"`{command}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def run_bash_command(command: str, env: dict, http_port: int | None) -> None:
    """`a && b && lmserve serve`: the parts before the server run first; a server is started, checked, stopped."""
    parts = [p.strip() for p in command.split(" && ")]
    for i, part in enumerate(parts):
        if SERVE.search(part):
            assert i == len(parts) - 1, "a README server command must end its line"
            server = Serve(substitute(part, env), env)
            try:
                server.wait_healthy()
            finally:
                server.stop()
        else:
            run(part, env, http_port)


# ---------------------------------------------------------------- the tests


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    blocks = [b for b in readme_blocks(README.read_text()) if b.lang == "bash"]
    assert commands(blocks[0]) == ["bash scripts/install.sh && .venv/bin/lmserve serve"]
    assert any(commands(b) == ["bash scripts/test.sh"] for b in blocks)
    # The second one is the suite itself: CI runs it (running it from inside the suite would recurse).
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text().splitlines()


def test_quick_start_fits_the_first_lines_and_links_every_page():
    """Install and serve, one curl, one openai-client call and the playground's URL, all in the first 40 lines;
    every docs/ page is linked from the README."""
    text = README.read_text()
    top = "\n".join(text.splitlines()[:QUICK_START_LINES])
    first = [b for b in readme_blocks(top)]
    assert commands(first[0]) == ["bash scripts/install.sh && .venv/bin/lmserve serve"]
    assert any(b.lang == "bash" and b.text.startswith("curl ") for b in first)
    assert any(b.lang == "python" and "OpenAI(" in b.text for b in first)
    assert "http://127.0.0.1:8000/" in top and "/exit" in top
    for b in first:  # a reader's first answers are reproducible: greedy, or seeded
        if "127.0.0.1:8000" in b.text:
            assert re.search(r"temperature\W+0\b|seed", b.text), b.text
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"


def test_few_blocks_are_exempt():
    exempt = [b for b in page_blocks() if b.not_run]
    assert len(exempt) <= MAX_NOT_RUN, [(b.page, b.line) for b in exempt]
    assert all(len(b.not_run) > 40 for b in exempt), "say why a block is not run"


@pytest.mark.timeout(1500)  # every server start and merge the README shows, in turn (~3-8 min on 2 cores)
def test_every_bash_command_runs(env):
    """Each command of each bash block (except the suite itself and exempt blocks), page by page, in order."""
    blocks = [b for b in page_blocks() if b.lang == "bash" and not b.not_run]
    before, ran = set(ROOT.iterdir()), 0
    try:
        for block in blocks:
            for command in commands(block):
                if command == "bash scripts/test.sh" or "127.0.0.1:8000" in command:
                    continue  # the suite itself (CI runs it); HTTP examples run in test_http_examples
                run_bash_command(command, env, None)
                ran += 1
    finally:  # what the commands wrote into the checkout (a payload log directory)
        for new in set(ROOT.iterdir()) - before:
            shutil.rmtree(new) if new.is_dir() else new.unlink()
    assert ran >= 8


def test_http_examples_against_the_quickstart_server(env):
    """curl, `lmserve bench serve` and the official clients' python blocks, against the quick-start server."""
    server = Serve(".venv/bin/lmserve serve", env)
    try:
        server.wait_healthy()
        http = [c for b in page_blocks() if b.lang == "bash" for c in commands(b) if "127.0.0.1:8000" in c]
        assert any(c.startswith("curl ") for c in http) and len(http) >= 2
        for c in http:
            if c.startswith("curl "):
                reply = json.loads(run(c + " --fail-with-body -sS", env, server.port))
                assert reply["choices"][0]["message"]["content"]
            else:
                assert run(c, env, server.port).strip()
        clients = [b for b in page_blocks() if b.lang == "python" and is_client(b)]
        assert len(clients) >= 2 and all(any(c in b.text for b in clients) for c in CLIENTS)
        for b in clients:
            script = substitute(b.text, env, server.port)
            r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=600)
            assert r.returncode == 0, f"{b.page} python block at line {b.line}:\n{r.stderr[-3000:]}"
            assert r.stdout.strip(), f"{b.page} python block at line {b.line} printed nothing"
    finally:
        server.stop()


def test_offline_python_blocks(env):
    """Python blocks that need no server run as one script per section, in order."""
    by_section: dict[str, list[Block]] = {}
    for b in page_blocks():
        if b.lang == "python" and not is_client(b):
            by_section.setdefault(f"{b.page}: {b.section}", []).append(b)
    assert by_section
    for section, blocks in by_section.items():
        script = substitute("\n".join(b.text for b in blocks), env)
        r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"README python in {section!r}:\n{r.stderr[-3000:]}"
        assert r.stdout.strip()


def test_json_blocks_parse():
    for b in page_blocks():
        if b.lang == "json":
            json.loads(b.text)


def test_inline_lmserve_commands_parse():
    """Every `lmserve ...` written in the prose names real subcommands, flags and valid values."""
    from lmserve.cli import build_parser

    found = inline_commands(pages_text(), "lmserve ")
    assert len(found) >= 5
    for command in found:
        argv = [PLACEHOLDERS.get(w, w) for w in argv_of(command)[1:]]
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, f"README's `{command}` does not parse"


HELP_ALL = """
import contextlib, io, json, os, runpy, sys, traceback
helps, path = {}, [p for p in sys.path if p not in ("", os.getcwd())]  # `python -c` put the cwd first
for script in sys.argv[1:]:
    sys.argv, sys.path[:] = [script, "--help"], [os.path.dirname(os.path.abspath(script)), *path]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
        except Exception:
            traceback.print_exc()  # to stderr: the script's flags are then missing from its help
    helps[script] = text.getvalue()
print(json.dumps(helps))
"""


@pytest.mark.timeout(1200)  # one `--help` process per script took 563 s and then over 600 s at load average ~16
def test_inline_benchmark_commands_name_real_flags():
    text = pages_text()
    found = [c for c in inline_commands(text, "python benchmarks/")] + inline_commands(text, "bash benchmarks/")
    assert found
    for command in found:
        assert (ROOT / argv_of(command)[1]).exists(), command
    scripts = sorted({argv_of(c)[1] for c in found if argv_of(c)[0] != "bash"})

    # One interpreter prints every script's --help, each run as `python SCRIPT --help` runs it (as __main__, its
    # folder first on sys.path): a process per script paid a Python start-up and a torch import each, ~2.5 CPU s
    # apiece for 19 scripts
    out = subprocess.run([sys.executable, "-c", HELP_ALL, *scripts], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    helps = json.loads(out.stdout.splitlines()[-1])
    for command in found:
        words = argv_of(command)
        if words[0] == "bash":
            continue
        helptext = helps[words[1]]
        for flag in (w for w in words[2:] if w.startswith("--") and " " not in w):  # a quoted value is no flag
            assert flag.split("=")[0] in helptext, \
                f"README's `{command}`: {flag} is not a flag of {words[1]}\n{out.stderr[-3000:]}"
