"""Optional C++ kernels: built at install time for each x86-64 instruction-set level, picked at run time.

One extension module (layers/kernels/csrc/): paged decode attention, the fused row-wise ops of a decoder
layer (RMSNorm with the residual add, SiLU-and-mul, rotary), the skinny matmul for steps of a few
rows (also over a bfloat16 head coded in 12 bits a weight: coded_half.cpp), and matmuls over a GGUF file's quantized codes (quant_gemm.cpp), all CPU float32.

`pip install` compiles it for the host's level only (setup.py); `LMSERVE_NATIVE_LEVELS=all pip wheel .` (the
Docker images) builds every level in LEVELS, so that wheel runs on any x86-64 machine without a compiler. At run
time the best level this CPU's flags allow (or LMSERVE_NATIVE_LEVEL's) is loaded, from:
1. the builds inside the package, if they were made from these sources for this torch (`_native_build.json`);
2. else ~/.cache/lmserve/kernels/<level>-<key>, where an earlier build of the same level, sources and torch
   lies (setup.py fills it too, so reinstalling compiles nothing);
3. else it is compiled there now, with torch's cpp_extension, once: a level the install did not build, a
   checkout whose kernels were edited, another torch, a non-x86 CPU; logged with a line per translation unit
   and timed apart from the model's load.
Where none works (no compiler, or LMSERVE_NATIVE_KERNELS=0), callers use the PyTorch paths, with one log
line. A build is made in a private directory and renamed into place, so an interrupted one never blocks a
later start. Each level's code differs where csrc/ tests the compiler's macros (__AVX2__, __AVX512VNNI__...):
the packed GGUF layout is read with VNNI on AVX-512 and with maddubs below it, and gguf_linear asks the loaded
build whether it has it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "LMSERVE_NATIVE_KERNELS"
ENV_LEVEL = "LMSERVE_NATIVE_LEVEL"  # a level's name: load that build instead of the best (each build's parity tests)
_CSRC = Path(__file__).parent / "csrc"
# The binding unit first: it alone includes torch's headers (csrc/kernels.h), so it is the long pole and ninja
# starts it first; the kernel units compile beside it in seconds.
_SOURCES = [_CSRC / name for name in ("bindings.cpp", "paged_decode_attention.cpp", "fused_ops.cpp", "gemv.cpp",
                                          "coded_half.cpp", "quant_gemm.cpp", "lora_delta.cpp",
                                          "encoder_attention.cpp")]
# fast-math lets GCC vectorise the reductions and exp; finite-math stays off (masked -inf must compare)
CFLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only")
BUILD_STAMP = Path(__file__).parent / "_native_build.json"  # written by setup.py beside the builds it made


class Level(NamedTuple):
    """One build: the compiler's target flags, and the /proc/cpuinfo flags a CPU needs to run its code."""

    name: str
    march: tuple[str, ...]
    needs: frozenset[str]

    @property
    def module(self) -> str:
        """The extension's module name (its PyInit symbol): one per level, so two never clash."""
        return "_native_" + self.name.replace("-", "_")


_V2 = frozenset("sse4_2 popcnt ssse3 cx16".split())
_V3 = _V2 | {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}  # abm: LZCNT
# Best first. No AMX level: no kernel here has AMX code, so such a build would be the AVX-512 one under
# another name (and -march=sapphirerapids would switch the 256-bit dots to AVX-VNNI, untested on this CPU).
LEVELS = (
    Level("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"),
          _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}),
    Level("x86-64-v3", ("-march=x86-64-v3",), _V3),  # AVX2 + FMA
    Level("x86-64-v2", ("-march=x86-64-v2",), _V2),  # SSE4.2: every x86-64 CPU since ~2009
)
# Only compiled at run time, never shipped: a CPU below every level (or not x86-64) gets a build for itself.
HOST = Level("host", ("-march=native",), frozenset())

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
_loaded_key: str | None = None  # level_key() of the build native_module() loaded
# Read once: the switch is a start-up setting, and this function runs ~100 times per decode step.
_on = os.environ.get(ENV_SWITCH, "1") != "0"


def native_module() -> ModuleType | None:
    """The loaded module (ops in csrc/bindings.cpp), or None where it is off or cannot be had."""
    global _module, _tried
    if _tried or not _on:
        return _module if _on else None
    with _lock:
        if not _tried:
            _module = _build()
            _tried = True
    return _module


def pick_level(flags: str, forced: str | None = None) -> Level:
    """The best level whose instructions the CPU (a cpuinfo flags line) has; HOST below them all.

    `forced` names a level (LMSERVE_NATIVE_LEVEL); one this CPU cannot run is refused, never loaded.
    """
    have = set(flags.split())
    if forced:
        level = next((lv for lv in (*LEVELS, HOST) if lv.name == forced), None)
        if level is None or not level.needs <= have:
            why = "unknown" if level is None else "needs " + ", ".join(sorted(level.needs - have))
            raise ValueError(f"{ENV_LEVEL}={forced}: {why} (levels: {', '.join(lv.name for lv in LEVELS)}, host)")
        return level
    return next((lv for lv in LEVELS if lv.needs <= have), HOST)


def level_key(level: Level, torch_version: str | None = None) -> str:
    """What a build depends on: the sources, torch's version (its ABI) and the compiler flags."""
    sources = b"".join(p.read_bytes() for p in sorted([*_CSRC.glob("*.cpp"), *_CSRC.glob("*.h")]))
    flags = " ".join(CFLAGS + level.march).encode()
    digest = hashlib.sha256(sources + (torch_version or torch.__version__).encode() + flags).hexdigest()[:16]
    return f"{level.name}-{digest}"


def cache_root() -> Path:
    return Path(os.environ.get("LMSERVE_CACHE_DIR", Path.home() / ".cache" / "lmserve")) / "kernels"


def _build() -> ModuleType | None:
    global _loaded_key
    from lmserve.utils import cpu_flags

    try:
        level = pick_level(cpu_flags(), os.environ.get(ENV_LEVEL))
        key = level_key(level)
        path = _bundled(level, key) or _library(cache_root() / key)
        where = "prebuilt" if path is not None and path.parent == BUILD_STAMP.parent else "cached"
        if path is None:
            with build_lock(cache_root() / key):  # another process building this key: wait, then take its build
                path = _library(cache_root() / key)
                if path is None:
                    _compile(level, cache_root(), cache_root() / key)
                    path, where = _library(cache_root() / key), "compiled"
        module = _import(path)
        _loaded_key = key
    except Exception as e:  # no compiler / ninja, or a build error: the PyTorch path still works
        log.warning("native CPU kernels unavailable (%s: %s); using the PyTorch paths", type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "")
        return None
    log.debug("native CPU kernels loaded from %s (%s build, %s)", path, level.name, where)  # nothing to say at INFO
    return module


def _bundled(level: Level, key: str) -> Path | None:
    """The package's own build of `level`, if setup.py made it from these sources for this torch."""
    try:
        stamp = json.loads(BUILD_STAMP.read_text())
    except (OSError, ValueError):
        return None
    if stamp.get(level.name) != key:
        log.info("the native kernels in the package were built from other sources or for another torch; "
                 "using a cached or new build")
        return None
    found = sorted(BUILD_STAMP.parent.glob(level.module + ".*so"))
    return found[0] if found else None


@contextmanager
def build_lock(final: Path) -> Iterator[None]:
    """Hold the one build of `final` across processes (setup.py and run-time starts alike).

    Two processes that need the same level at once (a wheel build beside a start, two test workers) would
    each compile it for minutes; the second now waits and takes the first's build. An flock: the kernel drops
    it when its holder dies, so a killed build never leaves a lock behind. Where locks cannot be taken (a
    read-only cache), both build, as before.
    """
    import fcntl

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        handle = open(final.parent / f".{final.name}.lock", "a")  # noqa: SIM115 - held for the with-block
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _compile(level: Level, root: Path, final: Path) -> None:
    """Build in a private directory, then rename it into place.

    The sources are copied next to the build so its files name no checkout: every checkout and venv
    with the same sources, torch and level shares one build. A build killed half-way leaves only its own
    temporary directory; a second process waits on `build_lock` instead of compiling the same build again;
    where no lock can be taken, two that build at once both succeed and the first rename wins.
    """
    import shutil
    import tempfile

    from torch.utils import cpp_extension

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"build-{final.name}-", dir=root))
    try:
        for src in [*_CSRC.glob("*.cpp"), *_CSRC.glob("*.h")]:
            shutil.copy2(src, tmp / src.name)
        log.info("compiling native kernels for %s (no build of it for these sources and torch %s here yet; "
                 "once) ...", level.name, torch.__version__)
        t0 = time.perf_counter()
        with build_progress(tmp, level.name, log.info), parallel_jobs():
            cpp_extension.load(name=level.module, sources=[str(tmp / p.name) for p in _SOURCES],
                               extra_cflags=[*CFLAGS, *level.march], extra_ldflags=["-fopenmp"],
                               build_directory=str(tmp), verbose=False)
        log.info("native kernels compiled in %.0f s", time.perf_counter() - t0)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: keep its build
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def host_level(flags: str) -> Level | None:
    """The level an install builds for this machine (a cpuinfo flags line); None below every level (run time
    compiles a `host` build instead)."""
    level = pick_level(flags)
    return level if level in LEVELS else None


@contextmanager
def parallel_jobs() -> Iterator[None]:
    """MAX_JOBS (torch's ninja runs) set to this process's cores unless set: ninja's own default, cores + 2, only
    adds memory (each translation unit that includes torch takes ~1 GB)."""
    had = os.environ.get("MAX_JOBS")
    if had is None:
        os.environ["MAX_JOBS"] = str(max(1, len(os.sched_getaffinity(0))))
    try:
        yield
    finally:
        if had is None:
            os.environ.pop("MAX_JOBS", None)


@contextmanager
def build_progress(directory: Path, level: str, emit: Callable[[str], None]) -> Iterator[None]:
    """A line per translation unit as its object file appears under `directory` (ninja, run quietly, says nothing
    until the end), then each unit's compile time from ninja's log."""
    start, seen = time.time(), set()
    stop = threading.Event()

    def report() -> None:
        for obj in sorted(directory.rglob("*.o")):
            if obj not in seen and obj.stat().st_mtime >= start:  # an earlier build's objects are not progress
                seen.add(obj)
                emit(f"native kernels {level}: {obj.stem} compiled ({len(seen)}/{len(_SOURCES)}, "
                     f"{time.time() - start:.0f} s)")

    def watch() -> None:
        while not stop.wait(0.5):
            report()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        report()
        times = unit_times(directory)
        if times:
            emit(f"native kernels {level}: seconds per unit: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))


def unit_times(directory: Path) -> dict[str, float]:
    """Each object's compile time in seconds, slowest first, from the newest .ninja_log under `directory`."""
    logs = sorted(directory.rglob(".ninja_log"), key=lambda p: p.stat().st_mtime)
    times = {}
    for line in logs[-1].read_text().splitlines()[1:] if logs else []:
        fields = line.split("\t")  # start ms, end ms, mtime, output, hash; a later run's line replaces an earlier
        if len(fields) == 5 and fields[3].endswith(".o"):
            times[Path(fields[3]).stem] = (int(fields[1]) - int(fields[0])) / 1000
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _library(directory: Path) -> Path | None:
    """The built extension in `directory`, if a complete build is there."""
    found = sorted(directory.glob("*.so")) if directory.is_dir() else []
    return found[0] if found else None


def _import(path: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the LoRA slot dtypes lora_delta_ reads (16-bit ones widened exactly to float32 as loaded): --lora-dtype
LORA_SLOT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def widens_half_fast() -> bool:
    """The loaded build widens float16 in vector loads (F16C): x86-64-v3 and AVX-512, or a host build on a CPU with
    AVX2 and F16C. Below them csrc/lora_delta.cpp widens one value at a time, 3-5x slower than float32 slots."""
    key = build_key()
    if key is None:
        return False
    level = key.rsplit("-", 1)[0]
    if level == HOST.name:
        from lmserve.utils import cpu_flags

        return {"avx2", "f16c"} <= set(cpu_flags().split())
    return level in ("avx512-vnni", "x86-64-v3")


def build_key() -> str | None:
    """The loaded build's level and key (sources, torch version, compiler flags), or None where the kernels are off:
    bytes they computed are reproduced only by the same build (the KV tier keys its blocks by it)."""
    return _loaded_key if native_module() is not None else None
