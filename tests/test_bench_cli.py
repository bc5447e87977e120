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


def test_roofline_counts_each_architectures_own_matrices():
    """FLOPs a token: BERT's MLP has two matrices and no LM head (all-MiniLM-L6-v2's shapes: 21.2 MFLOP, the count
    benchmarks/encoder_throughput.py's float32 ceiling divides by); a decoder's is gated and has its head; an MoE layer
    runs its top-k experts, not all of them."""
    from lmserve.bench.roofline import flops_per_token
    from lmserve.models.config import ModelConfig

    def cfg(**kw):
        base = dict(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=256,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
        return ModelConfig(**{**base, **kw})

    minilm = cfg(architecture="BertModel", vocab_size=30522, hidden_size=384, intermediate_size=1536, num_layers=6,
                 num_heads=12, num_kv_heads=12, head_dim=32, hidden_act="gelu", encoder=True)
    assert flops_per_token(minilm) == 2 * 6 * (4 * 384 * 384 + 2 * 384 * 1536) == 21_233_664
    attention = 2 * 64 * 64 + 64 * 32 * 2  # q and o (4 heads of 16), k and v (2 heads)
    assert flops_per_token(cfg()) == 2 * (2 * (attention + 3 * 64 * 256) + 64 * 1000)
    assert flops_per_token(cfg(), context=10) == flops_per_token(cfg()) + 2 * 2 * (2 * 4 * 16 * 10)
    moe = cfg(architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    assert flops_per_token(moe) == 2 * (2 * (attention + 3 * 64 * 32 * 2 + 64 * 8) + 64 * 1000)
    # Qwen2-MoE: a dense first layer; a shared expert (and its gate, hidden -> 1) beside the routed ones
    shared = cfg(architecture="Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, dense_layers=(0,))
    assert flops_per_token(shared) == 2 * (2 * attention + 3 * 64 * 256 + 3 * 64 * 32 * 2 + 64 * 4 + 3 * 64 * 64 + 64
                                           + 64 * 1000)
    # ModernBERT: an encoder (no LM head) whose MLP is gated (one hidden -> 2 x intermediate matrix, then down)
    modern = cfg(architecture="ModernBertModel", num_kv_heads=4, hidden_act="gelu", encoder=True)
    assert flops_per_token(modern) == 2 * 2 * (4 * 64 * 64 + 3 * 64 * 256)
