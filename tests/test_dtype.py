"""`--dtype auto` from a given CPU flags line: float32 on every CPU without AMX, bf16 with AMX and on CUDA."""

from __future__ import annotations

import pytest
import torch

from lmserve.utils import auto_dtype, cpu_has_fast_bf16, resolve_dtype

ZEN3 = "flags\t\t: fpu sse sse2 avx avx2 fma f16c"
ZEN4 = ZEN3 + " avx512f avx512bw avx512vl avx512_bf16"  # native bf16 dot products, no AMX
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no CUDA to exist


@pytest.mark.parametrize("flags,dtype", [
    (ZEN3, torch.float32), (ZEN4, torch.float32), (SAPPHIRE_RAPIDS, torch.bfloat16), ("", torch.float32),
], ids=["avx2", "avx512_bf16", "amx", "unreadable"])
def test_auto_on_cpu_is_float32_unless_amx(flags, dtype):
    assert auto_dtype(CPU, flags) == dtype


@pytest.mark.parametrize("flags", [ZEN3, ZEN4, SAPPHIRE_RAPIDS])
def test_auto_on_cuda_is_bf16_whatever_the_host_cpu(flags):
    assert auto_dtype(CUDA, flags) == torch.bfloat16


def test_native_bf16_still_counts_avx512_bf16_for_an_explicit_bf16():
    # oneDNN packing of explicit --dtype bfloat16 weights needs native bf16, AMX or not.
    assert cpu_has_fast_bf16(ZEN4) and cpu_has_fast_bf16(SAPPHIRE_RAPIDS) and not cpu_has_fast_bf16(ZEN3)


def test_resolve_dtype_names():
    assert resolve_dtype("auto", CPU) == auto_dtype(CPU)  # this machine's flags
    assert resolve_dtype("bf16", CPU) == torch.bfloat16 and resolve_dtype("float32", CUDA) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", CPU)
