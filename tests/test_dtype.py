"""`--dtype auto`: bf16 on CUDA; on a CPU float32 unless, with AMX, a measurement (made once, cached) finds bf16
clearly faster and batch invariant; float32 where a GGUF file's blocks are kept; no measurement without AMX."""

from __future__ import annotations

import json

import pytest
import torch

from lmserve.cpu_dtype import auto_dtype, cache_file, decide, resolve_dtype
from lmserve.utils import cpu_has_fast_bf16, keeps_gguf, resolve_kv_dtype

ZEN3 = "flags\t\t: fpu sse sse2 avx avx2 fma f16c"
ZEN4 = ZEN3 + " avx512f avx512bw avx512vl avx512_bf16"  # native bf16 dot products, no AMX
ZEN5 = ZEN4 + " avx512_vnni avx512_vp2intersect avx_vnni"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no CUDA to exist


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def measured_files(root):
    return sorted((root / "kernels").glob("dtype-*.json")) if (root / "kernels").exists() else []


@pytest.mark.parametrize("flags", [ZEN3, "", ZEN4, ZEN5], ids=["avx2", "unreadable", "zen4", "zen5"])
def test_no_amx_is_float32_without_measuring(flags, cache_dir):
    assert auto_dtype(CPU, flags) == torch.float32
    assert measured_files(cache_dir) == []


@pytest.mark.parametrize("flags", [ZEN3, ZEN4, SAPPHIRE_RAPIDS])
def test_auto_on_cuda_is_bf16_whatever_the_host_cpu(flags):
    assert auto_dtype(CUDA, flags) == torch.bfloat16


def test_kept_gguf_blocks_take_float32_activations(cache_dir):
    assert auto_dtype(CPU, SAPPHIRE_RAPIDS, kept_gguf=True) == torch.float32
    assert measured_files(cache_dir) == []
    assert keeps_gguf(None, "auto", CPU) and keeps_gguf("/m/model.Q4_1.GGUF", "gguf", CPU)
    assert not keeps_gguf("/m/model.gguf", "none", CPU) and not keeps_gguf("/m/hf-dir", "auto", CPU)
    assert not keeps_gguf(None, "auto", CUDA)


def numbers(prefill_speedup: float, decode_speedup: float, invariant: bool) -> dict:
    return {"prefill_f32": 1.0, "prefill_bf16": 1.0 / prefill_speedup, "decode_f32": 1.0,
            "decode_bf16": 1.0 / decode_speedup, "bf16_batch_invariant": invariant}


@pytest.mark.parametrize("m,dtype", [
    (numbers(4.0, 1.3, True), "bfloat16"),  # an AMX-like result
    (numbers(4.0, 1.3, False), "float32"),  # fast but a row's bits depend on its batch
    (numbers(1.5, 1.0, True), "float32"),  # not worth the native float32 kernels it gives up
    (numbers(0.65, 0.9, True), "float32"),  # this AVX512_BF16 Xeon without AMX
    (numbers(3.0, 0.7, True), "float32"),  # slower single rows (decode)
])
def test_decision_from_the_measurement(m, dtype):
    assert decide(m)[0] == dtype


def test_measured_once_on_this_machine_then_read_from_the_cache(cache_dir):
    first = auto_dtype(CPU, SAPPHIRE_RAPIDS)  # this machine's matmuls, under an AMX flags line
    [path] = measured_files(cache_dir)
    assert path == cache_file(SAPPHIRE_RAPIDS)
    record = json.loads(path.read_text())
    assert str(first) == f"torch.{record['dtype']}" and record["why"]
    m = record["measured"]
    assert all(m[k] > 0 for k in ("prefill_f32", "prefill_bf16", "decode_f32", "decode_bf16"))
    assert isinstance(m["bf16_batch_invariant"], bool)
    assert decide(m)[0] == record["dtype"]
    # the next start reads the file: a different cached decision is what it returns, with nothing re-measured
    record["dtype"] = "bfloat16" if record["dtype"] == "float32" else "float32"
    path.write_text(json.dumps(record))
    assert str(auto_dtype(CPU, SAPPHIRE_RAPIDS)) == f"torch.{record['dtype']}"
    assert measured_files(cache_dir) == [path]
    path.write_text("{not json")  # a damaged cache is measured again, not trusted: a fresh, whole record whose
    # decision is its own measurement's (not necessarily `first`'s: on a busy machine a close call may tip)
    again = auto_dtype(CPU, SAPPHIRE_RAPIDS)
    redone = json.loads(path.read_text())
    assert str(again) == f"torch.{redone['dtype']}" and decide(redone["measured"])[0] == redone["dtype"]
    assert all(redone["measured"][k] > 0 for k in ("prefill_f32", "prefill_bf16", "decode_f32", "decode_bf16"))


def test_native_bf16_still_counts_avx512_bf16_for_an_explicit_bf16():
    # oneDNN packing of explicit --dtype bfloat16 weights needs native bf16, AMX or not.
    assert cpu_has_fast_bf16(ZEN4) and cpu_has_fast_bf16(SAPPHIRE_RAPIDS) and not cpu_has_fast_bf16(ZEN3)


def test_resolve_dtype_names():
    assert resolve_dtype("auto", CPU) == auto_dtype(CPU)  # this machine's flags
    assert resolve_dtype("auto", CPU, kept_gguf=True) == torch.float32
    assert resolve_dtype("bf16", CPU) == torch.bfloat16 and resolve_dtype("float32", CUDA) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", CPU)


def test_kv_cache_dtype():
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert resolve_kv_dtype("auto", f32, True, CPU) == f16  # kept GGUF blocks: llama.cpp's KV type
    assert resolve_kv_dtype("auto", f32, False, CPU) == f32 and resolve_kv_dtype("auto", bf16, False, CUDA) == bf16
    assert resolve_kv_dtype("float32", f32, True, CPU) == f32 and resolve_kv_dtype("float16", f32, False, CPU) == f16
    with pytest.raises(ValueError, match="model's dtype"):
        resolve_kv_dtype("float16", bf16, False, CUDA)
    assert resolve_kv_dtype("int8", f32, True, CPU) == torch.int8  # issue 32: a quantized cache (test_kv_quant.py)
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        resolve_kv_dtype("int4", f32, False, CPU)
