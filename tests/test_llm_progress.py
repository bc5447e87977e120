"""LLM.generate's progress bar: on stderr for a batch, prompts done and tok/s as vLLM shows them; off with
use_tqdm=False."""

from __future__ import annotations

import pytest

from lmserve import LLM, SamplingParams
from tests.conftest import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("progress") / "tiny"
    write_tiny_llama(path)
    return LLM(str(path), dtype="float32", num_threads=2, num_blocks=128)


def test_a_batch_shows_prompts_done_and_speed_on_stderr(tiny_llm, capsys):
    params = [SamplingParams(max_tokens=m, ignore_eos=True, n=n) for m, n in ((2, 1), (6, 2), (12, 1))]
    outs = tiny_llm.generate(["w5 w9", "w17", "w33 w65 w7"], params)
    assert [len(o.token_ids) for r in outs for o in r.outputs] == [2, 6, 6, 12]
    captured = capsys.readouterr()
    assert captured.out == ""
    final = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("Processed prompts: 100%") and "3/3" in final  # prompts, not completions (n=2)
    assert "est. speed input:" in final and "output:" in final and final.endswith("toks/s]")


def test_use_tqdm_false_draws_nothing(tiny_llm, capsys):
    tiny_llm.generate(["w5 w9", "w17"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert capsys.readouterr() == ("", "")


def test_a_script_without_logging_setup_sees_the_load_lines(tmp_path):
    """A plain script (no logging.basicConfig) still sees lmserve's INFO lines on stderr, stdout untouched;
    an application that set up logging keeps its own configuration (no second handler)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "tiny"
    write_tiny_llama(path)
    script = ("import logging, sys\nfrom lmserve import LLM\n"
              "if sys.argv[1] == 'configured': logging.basicConfig(level=logging.WARNING)\n"
              f"LLM({str(path)!r}, dtype='float32', num_threads=1, num_blocks=16)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    plain = subprocess.run([sys.executable, "-c", script, "plain"], capture_output=True, text=True, env=env,
                           timeout=120, check=True)
    assert "INFO lmserve.loader: loaded tiny" in plain.stderr and plain.stdout == ""
    configured = subprocess.run([sys.executable, "-c", script, "configured"], capture_output=True, text=True,
                                env=env, timeout=120, check=True)
    assert "INFO" not in configured.stderr
