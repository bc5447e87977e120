"""The command line a vLLM or Ollama user expects: `serve MODEL`, `--version`, `pull` / `list` from the Hugging Face
cache, `serve --help` in groups with every flag described and its default shown, two lines for a bad value."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from lmserve import __version__
from lmserve.cli import build_parser, parse_args
from tests.conftest import write_hub_snapshot

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
GROUPS = ["model", "engine", "speculative decoding", "LoRA", "scale-out", "server", "security",
          "observability (all off by default but the access log)"]


def lmserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_serve_help_is_grouped_and_every_flag_has_help_and_its_default():
    parser = serve_parser()
    titles = [g.title for g in parser._action_groups if g._group_actions]
    assert [t for t in titles if t in GROUPS] == GROUPS
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.metavar
        text = formatter._expand_help(action) if action.help else ""
        assert len(text) > 10, f"{name} has no help"
        switch = isinstance(action, argparse._StoreTrueAction)  # off unless given: nothing else to show
        assert switch or not action.option_strings or "default" in text, f"{name}: no default in {text!r}"
    out = lmserve("serve", "--help").stdout
    assert "(default: 127.0.0.1)" in out and "(default: 8000)" in out and "(default: 64)" in out  # host, port, seqs
    assert "measurement" in out  # --dtype auto is measured on a CPU, as docs/models.md says


def test_a_bad_value_prints_two_lines_not_the_whole_usage():
    p = lmserve("serve", "--dtype", "fp16")
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        "usage: lmserve serve [MODEL] [options] (see lmserve serve --help)",
        "lmserve serve: error: argument --dtype: invalid choice: 'fp16' (choose from 'auto', 'float32', 'bfloat16', "
        "'float16')"]


def test_version():
    p = lmserve("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"lmserve {__version__}"


def test_serve_takes_the_model_as_a_positional_argument():
    assert parse_args(["serve", HUB_ID]).model == [HUB_ID]
    assert parse_args(["serve", "--model", HUB_ID]).model == [HUB_ID]
    assert parse_args(["serve", HUB_ID, "--port", "9000"]).port == 9000
    with pytest.raises(SystemExit):
        parse_args(["serve", HUB_ID, "--model", HUB_ID])


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache holding a tiny checkpoint under HUB_ID, as `hf download` leaves one."""
    cache = tmp_path_factory.mktemp("hub")
    write_hub_snapshot(cache, HUB_ID, SNAPSHOT)
    (cache / "models--org--gguf-only" / "snapshots" / SNAPSHOT).mkdir(parents=True)  # a repo lmserve cannot serve
    (cache / "models--org--gguf-only" / "snapshots" / SNAPSHOT / "notes.txt").write_text("x")
    return cache


def test_pull_finds_a_cached_model_offline_and_list_shows_it(hub_cache):
    env = {"HF_HUB_CACHE": str(hub_cache)}
    p = lmserve("pull", HUB_ID, env=env)
    assert p.returncode == 0, p.stderr
    assert f"{HUB_ID} (safetensors" in p.stdout and SNAPSHOT in p.stdout and f"lmserve serve {HUB_ID}" in p.stdout
    listed = lmserve("list", env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["NAME", "REVISION", "FORMAT", "SIZE", "MODIFIED"]
    assert re.search(rf"^{re.escape(HUB_ID)}\s+main\s+safetensors\s+[0-9.]+ MB", listed.stdout, re.M)
    assert "(embedded)" in lines[-1] and "gguf" in lines[-1]
    assert "org/gguf-only" not in listed.stdout
    assert "org/gguf-only" in lmserve("list", "--all", env=env).stdout


def test_pull_and_list_answer_without_importing_torch(hub_cache):
    """The Hub cache is files: `pull` and `list` never import torch (they did through the loader package: 3.4-3.7 s of
    each on a first-generation Zen, against ~0.7 s for the whole command without it)."""
    for args in (["pull", HUB_ID], ["list"]):  # PYTHONPROFILEIMPORTTIME: -X importtime's lines on stderr
        p = lmserve(*args, env={"HF_HUB_CACHE": str(hub_cache), "PYTHONPROFILEIMPORTTIME": "1"})
        assert p.returncode == 0, p.stderr[-2000:]
        imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
        assert "huggingface_hub" in imported and "torch" not in imported, args


def test_pull_of_a_model_not_in_the_cache_offline_is_one_line(hub_cache):
    p = lmserve("pull", "org/not-cached", env={"HF_HUB_CACHE": str(hub_cache)})
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("lmserve: error: model org/not-cached: not in the local Hugging Face cache")


def test_an_error_names_a_path_once(tmp_path):
    p = lmserve("generate", "hi", "--model", str(tmp_path))
    assert p.returncode == 2
    assert p.stderr.count(str(tmp_path)) == 1, p.stderr
