"""The native kernels' instruction-set levels: which build a CPU picks, and each build this CPU can run equals
the references (the same parity tests the best build passes, run again with that build forced)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.layers.kernels import native
from lmserve.utils import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
V2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt cx16"
V3 = V2 + " avx avx2 fma bmi1 bmi2 f16c movbe abm xsave"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"
# The kernels' parity tests against their plain references (attention, fused ops, skinny matmul, GGUF int8 dots,
# LoRA deltas, the K/V cache writers: each level has its own vector path for them)
PARITY = ["tests/test_native_ops.py", "tests/test_native_attention.py", "tests/test_gguf_linear.py",
          "tests/test_lora_native.py", "tests/test_kv_quant.py",
          "tests/test_gguf_embedding.py::test_the_native_lookup_equals_its_reference"]


@pytest.mark.parametrize("flags,level", [
    (V4 + " avx512_vnni", "avx512-vnni"),
    (V4, "x86-64-v3"),  # AVX-512 without VNNI: the AVX2 build (its int8 dots need VNNI to pay)
    (V3, "x86-64-v3"),
    (V3.replace(" fma", ""), "x86-64-v2"),
    (V2, "x86-64-v2"),
    ("fpu sse sse2", "host"),  # below every level (or not x86): compiled for itself at run time
    ("", "host"),
])
def test_the_best_level_the_cpu_flags_allow(flags, level):
    assert native.pick_level(flags).name == level


def test_a_forced_level_must_exist_and_run_here():
    assert native.pick_level(V4 + " avx512_vnni", "x86-64-v2").name == "x86-64-v2"
    with pytest.raises(ValueError, match="needs avx512_vnni"):
        native.pick_level(V4, "avx512-vnni")
    with pytest.raises(ValueError, match="unknown"):
        native.pick_level(V4, "x86-64-v9")


def test_each_level_has_its_own_key_module_and_flags():
    keys = {native.level_key(lv) for lv in native.LEVELS}
    assert len(keys) == len(native.LEVELS)
    assert len({lv.module for lv in native.LEVELS}) == len(native.LEVELS)
    assert native.level_key(native.LEVELS[0], "2.13.0") != native.level_key(native.LEVELS[0], "2.14.0")
    assert all("-march=native" not in lv.march for lv in native.LEVELS)  # shipped builds run on other CPUs


def test_a_stale_package_build_is_not_loaded(monkeypatch, tmp_path):
    """A checkout whose kernels changed after `pip install -e .` built them: its stamp no longer matches."""
    stamp = tmp_path / "_native_build.json"
    level = native.LEVELS[-1]
    (tmp_path / f"{level.module}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    monkeypatch.setattr(native, "BUILD_STAMP", stamp)
    stamp.write_text('{"%s": "other-key"}' % level.name)
    assert native._bundled(level, native.level_key(level)) is None
    stamp.write_text('{"%s": "%s"}' % (level.name, native.level_key(level)))
    assert native._bundled(level, native.level_key(level)).parent == tmp_path


HOLD = """
import sys, time
from pathlib import Path
from lmserve.layers.kernels import native
with native.build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    (Path(sys.argv[1]) / "built").parent.mkdir(parents=True, exist_ok=True)
    (Path(sys.argv[1]) / "built").write_text("x")
"""


def test_a_second_build_of_one_key_waits_for_the_first_and_a_killed_holder_frees_it(tmp_path):
    """Two processes wanting the same build (a wheel beside a start, two test workers) compile it once; a build
    killed half-way leaves no lock behind."""
    import time

    final = tmp_path / "x86-64-v2-key"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(final), "1.5"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    start = time.perf_counter()
    with native.build_lock(final):
        waited = time.perf_counter() - start
        assert (final / "built").exists()  # the first's build is there when the second gets the lock
    assert holder.wait(30) == 0 and waited > 0.5
    (final / "built").unlink()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(final), "600"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(30)
    start = time.perf_counter()
    with native.build_lock(final):
        assert time.perf_counter() - start < 5 and not (final / "built").exists()


RUNNABLE = [lv.name for lv in native.LEVELS if lv.needs <= set(cpu_flags().split())]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the PARITY tests in a child process; ~7 min a level at load average ~15
@pytest.mark.skipif(os.environ.get(native.ENV_SWITCH) == "0", reason="native kernels switched off")
@pytest.mark.parametrize("level", RUNNABLE or ["none"])
def test_each_build_this_cpu_runs_equals_the_references(level):
    """The parity tests again, in a process that loads this level's build (cached, or compiled once); the build
    the suite itself runs on is only probed."""
    if level == "none":
        pytest.skip("this CPU runs no shipped level (below x86-64-v2, or not x86)")
    env = {**os.environ, native.ENV_LEVEL: level}
    probe = ("import logging\nlogging.basicConfig(level=logging.DEBUG)\nfrom lmserve.layers.kernels import native\n"
             "m = native.native_module()\nprint(m.__name__, m.quant_packed_rows())")
    for attempt in ("first", "second"):  # a level the install did not build is compiled at its first use, once
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=1200,
                             cwd=ROOT)
        module, rows = out.stdout.split()
        assert module == native.pick_level(cpu_flags(), level).module, out.stderr[-2000:]
        assert int(rows) == 16  # the packed GGUF layout: every shipped level (VNNI dots on AVX-512, maddubs below)
        where = re.search(rf"\({level} build, (\w+)\)", out.stderr)
        assert where is not None, out.stderr[-2000:]
        if attempt == "second":
            assert where.group(1) in ("prebuilt", "cached"), out.stderr[-2000:]
        elif where.group(1) == "compiled":  # logged: a line per translation unit as it is done, then the time
            assert f"native kernels {level}: bindings compiled" in out.stderr, out.stderr[-2000:]
            assert "native kernels compiled in" in out.stderr, out.stderr[-2000:]
    if level == native.pick_level(cpu_flags(), os.environ.get(native.ENV_LEVEL)).name:
        return  # the build this process loads: the suite's own run of PARITY already tests it (saves ~1/3 here)
    # The kernels' parity tests only: the three that run the embedded model through them (an engine's tokens, the
    # model from its blocks, a LoRA delta beside its blocks) compose the same kernels and run on the suite's own
    # build; on a slow level they cost more than every kernel test together (the LoRA one alone: 73 of 90 s at
    # x86-64-v2; its delta is a PyTorch matmul, the same at every level)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *PARITY, "-k",
                        "not engine_tokens_equal_with_and_without and not embedded_model_from_its_own_blocks"
                        " and not lora_delta_runs_beside_the_gguf_blocks"],
                       env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:]
    assert " passed" in p.stdout, p.stdout[-1000:]


@pytest.mark.slow
@pytest.mark.skipif(not {"avx2", "fma"} <= set(cpu_flags().split()), reason="runs the x86-64-v3 build: needs AVX2")
def test_the_assembly_tiles_equal_the_intrinsics_they_replace(tmp_path):
    """quant_gemm.cpp's U4 and U8 4-row tiles with their integer pass in inline assembly (x86-64-v3) against the same
    source built with -DLMSERVE_NO_ASM (the intrinsics): benchmarks/quant_gemm_cpu.cpp's output hashes, every kind at
    M = 1 and 16 (16 rows run four assembly tiles), on two shapes (K a multiple of 256: the K-quants). Compiled
    straight from the kernel sources (no torch headers): ~10 s each."""
    csrc = ROOT / "src" / "lmserve" / "layers" / "kernels" / "csrc"
    flags = [*native.CFLAGS, "-march=x86-64-v3", "-std=c++17", f"-I{csrc}"]
    builds = {name: tmp_path / name for name in ("asm", "no_asm")}
    compiles = [subprocess.Popen(["g++", *flags, *(["-DLMSERVE_NO_ASM"] if name == "no_asm" else []),
                                  str(ROOT / "benchmarks" / "quant_gemm_cpu.cpp"), str(csrc / "quant_gemm.cpp"),
                                  "-o", str(exe)], stderr=subprocess.PIPE, text=True)
                for name, exe in builds.items()]
    for c in compiles:
        assert c.wait(timeout=600) == 0, c.stderr.read()[-2000:]
    hashes = {}
    for name, exe in builds.items():
        lines = [subprocess.run([str(exe), str(kind), *shape, "1"], capture_output=True, text=True, check=True,
                                timeout=120).stdout for kind in range(7) for shape in (("1536", "768"), ("48", "256"))]
        hashes[name] = [line.split("check")[-1].strip() for line in lines]
    assert hashes["asm"] == hashes["no_asm"]
    assert len(set(hashes["asm"])) == len(hashes["asm"])  # every kind and shape its own outputs
