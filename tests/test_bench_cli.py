"""`lmserve bench latency | throughput` as a user runs them: real processes on the embedded model, tiny sizes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from lmserve.bench.report import Column, format_table, load_note

TINY = ["--input-len", "8", "--output-len", "4", "--batch-sizes", "1,2", "--kv-cache-memory", str(64 * 2**20)]
LATENCY_KEYS = {"batch_size", "input_len", "output_len", "ttft_ms", "tpot_ms", "prefill_tok_s", "decode_tok_s",
                "decode_ceiling_tok_s", "pct_of_decode_ceiling", "warmup_ttft_ms", "warmup_tpot_ms"}
THROUGHPUT_KEYS = {"batch_size", "num_prompts", "input_len", "output_len", "seconds", "output_tok_s", "total_tok_s",
                   "achieved_tflops", "pct_of_compute_ceiling"}


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.cli", "--log-level", "warning", "bench", *args],
                          capture_output=True, text=True, timeout=120)


def test_latency_prints_a_table_and_shows_progress_on_stderr():
    p = bench("latency", *TINY, "--num-iters", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[1].split() == ["batch", "input", "tokens", "output", "tokens", "TTFT", "ms", "TPOT", "ms", "prefill",
                                "tok/s", "decode", "tok/s", "decode", "ceiling", "tok/s", "%", "of", "ceiling"]
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"]
    assert "{" not in p.stdout  # the table, not JSON
    assert "loading the model" in p.stderr and "latency: 100%" in p.stderr  # the tqdm bar reached its end


def test_latency_json_has_the_documented_keys_and_output_file(tmp_path):
    out = tmp_path / "lat.json"
    p = bench("latency", *TINY, "--num-iters", "1", "--json", "--output", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert json.loads(out.read_text()) == result
    assert {"kind", "model", "dtype", "num_threads", "machine_load", "roofline", "runs"} <= set(result)
    assert [r["batch_size"] for r in result["runs"]] == [1, 2]
    for r in result["runs"]:
        assert set(r) == LATENCY_KEYS
        assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and math.isclose(r["decode_tok_s"], 1e3 * r["batch_size"] / r["tpot_ms"])


def test_throughput_json_one_row_per_batch_size():
    p = bench("throughput", *TINY, "--num-prompts", "2", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(p.stdout)["runs"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert all(set(r) == THROUGHPUT_KEYS and r["output_tok_s"] > 0 for r in rows)
    assert "throughput: 100%" in p.stderr


def test_bad_batch_sizes_are_refused_by_the_parser():
    p = bench("latency", "--batch-sizes", "1,x")
    assert p.returncode == 2 and "expected positive integers" in p.stderr


def test_format_table_aligns_columns_and_prints_nan_as_dash():
    cols = [Column("b", "batch", "{}"), Column("t", "TPOT ms")]
    assert format_table([{"b": 1, "t": 25.04}, {"b": 16, "t": float("nan")}], cols).splitlines() == [
        "batch  TPOT ms", "    1     25.0", "   16        -"]


@pytest.mark.parametrize("others,noted", [(0.05, False), (1.0, True)])
def test_load_note_only_when_others_used_the_cpu(others, noted):
    note = load_note({"other_processes_cores": others, "cores": 2, "loadavg_1m_at_end": 1.0})
    assert (note is not None) == noted
