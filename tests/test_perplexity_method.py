"""benchmarks/perplexity.py scores what llama-perplexity scores: hand-computed windows, targets and PPL, and its
logits file parsed back (no model runs here)."""

from __future__ import annotations

import importlib.util
import math
import struct
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ppl():
    spec = importlib.util.spec_from_file_location("perplexity_bench", ROOT / "benchmarks" / "perplexity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_windows_drop_the_tail_and_take_bos_without_touching_the_tokens(ppl):
    tokens = [5, 1, 2, 3, 0, 2, 1, 3, 4, 4]
    assert ppl.chunk_windows(tokens, 4, None) == [[5, 1, 2, 3], [0, 2, 1, 3]]
    assert ppl.chunk_windows(tokens, 4, 9) == [[9, 1, 2, 3], [9, 2, 1, 3]]
    assert tokens == [5, 1, 2, 3, 0, 2, 1, 3, 4, 4]


def test_second_half_scored_as_llama_perplexity_counts_it(ppl):
    # perplexity.cpp: first = n_ctx/2; logits at first .. n_ctx-2 score n_ctx - first - 1 tokens per window
    assert list(ppl.scored_targets(4)) == [3]
    assert ppl.scored_targets(512) == range(257, 512) and len(ppl.scored_targets(512)) == 255


def test_hand_computed_perplexity(ppl):
    # window 1: row 2 gives token 3 weight 3 against 1+1+1 -> p = 1/2; window 2: row 2 uniform -> p = 1/4.
    # Every other row is junk that must not be read.
    junk = np.full((4, 4), 50.0, dtype=np.float32)
    a, b = junk.copy(), junk.copy()
    a[2] = [0, 0, 0, math.log(3)]
    b[2] = 0
    nll = np.concatenate([ppl.window_nll(a, [5, 1, 2, 3]), ppl.window_nll(b, [0, 2, 1, 3])])
    np.testing.assert_allclose(nll, [math.log(2), math.log(4)], rtol=1e-6)
    assert ppl.perplexity(nll) == pytest.approx(2 ** 1.5, rel=1e-6)


def test_read_text_removes_one_trailing_newline_as_dash_f_does(ppl, tmp_path):
    (tmp_path / "t.txt").write_text("a\n\n")
    assert ppl.read_text(tmp_path / "t.txt") == "a\n"


def test_saved_logits_file_parsed(ppl, tmp_path):
    # llama-perplexity --save-all-logits: header, tokens, then per scored row two floats and n_vocab uint16 (+ pad)
    n_ctx, n_vocab = 4, 3
    row = struct.pack("<2f", 0.5, -3.0) + struct.pack("<4H", 0, 4, 2, 0)  # nv = 2 * ((3 + 1) // 2) + 4 = 8
    path = tmp_path / "logits.bin"
    path.write_bytes(b"_logits_" + struct.pack("<3i", n_ctx, n_vocab, 1) + struct.pack("<4i", 0, 1, 2, 1) + row)
    got = ppl.read_saved_logits(path, n_ctx)
    assert got["tokens"] == [0, 1, 2, 1]
    np.testing.assert_allclose(got["nll"], [1.0])  # target token 1: -3 + 0.5 * 4 = -1
    assert got["top1"] == [1]


def test_common_prefix(ppl):
    assert ppl.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert ppl.common_prefix([1, 2], [1, 2, 3]) == 2
    assert ppl.common_prefix([], [1]) == 0
