"""The native CPU kernels, compiled at install time for this machine's instruction-set level (layers/kernels/native.py).

Everything else about the package is in pyproject.toml. Each level in native.LEVELS becomes an extension
module `lmserve.layers.kernels._native_<level>`; `_native_build.json` beside them records which sources and torch each
was built from, so a checkout whose kernels changed since falls back to a build at run time. Builds are also
kept in ~/.cache/lmserve/kernels (the run-time cache, same keys): a reinstall, a new venv or `pip wheel .`
copies them instead of compiling again.

Without torch in the build environment (`pip install --no-build-isolation` in a venv that lacks it), no
extension is built and lmserve compiles at first use instead. By default only the level this CPU runs is built
(the other levels, where LMSERVE_NATIVE_LEVEL forces one, are compiled once at first use);
LMSERVE_NATIVE_LEVELS=all builds every level (a wheel or an image for other machines),
LMSERVE_NATIVE_LEVELS=avx512-vnni,x86-64-v3 the named ones, LMSERVE_NATIVE_LEVELS=none none. Each level's
translation units compile in parallel (MAX_JOBS, else one job a core), a line on stderr as each is done (pip
shows them with -v; scripts/install.sh shows them always).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
PACKAGE = "lmserve.layers.kernels"


def load_native():
    """lmserve/layers/kernels/native.py alone (it needs torch, not the rest of lmserve), or None without torch."""
    if importlib.util.find_spec("torch") is None:
        print("setup.py: torch is not installed here: no native kernels built (lmserve compiles them at first "
              "use)", file=sys.stderr)
        return None
    spec = importlib.util.spec_from_file_location("_lmserve_native_build", ROOT / "src/lmserve/layers/kernels/native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_flags() -> str:
    """This CPU's /proc/cpuinfo flags ('' where unreadable: no level then, lmserve compiles at first use)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def chosen_levels(native) -> list:
    wanted = os.environ.get("LMSERVE_NATIVE_LEVELS", "").strip()
    if not wanted:
        level = native.host_level(host_flags())
        return [level] if level is not None else []
    if wanted == "all":
        return list(native.LEVELS)
    names = {n.strip() for n in wanted.split(",")} - {"none"}
    unknown = names - {lv.name for lv in native.LEVELS}
    if unknown:
        raise SystemExit(f"LMSERVE_NATIVE_LEVELS: unknown level(s) {sorted(unknown)}")
    return [lv for lv in native.LEVELS if lv.name in names]


def extensions_and_commands() -> tuple[list, dict]:
    native = load_native()
    if native is None:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    levels = {f"{PACKAGE}.{lv.module}": lv for lv in chosen_levels(native)}
    if not levels:
        print("setup.py: native kernels to build: none", file=sys.stderr)
        return [], {}
    sources = [str(p.relative_to(ROOT)) for p in native._SOURCES]
    # -g0: python's own CFLAGS ask for debug info, 10x the library's size
    exts = [CppExtension(name, sources, extra_compile_args=[*native.CFLAGS, *lv.march, "-g0"],
                         extra_link_args=["-fopenmp"]) for name, lv in levels.items()]

    class BuildLevels(BuildExtension):
        """BuildExtension that reuses a build of the same key from the kernel cache, fills it, and stamps."""

        def build_extension(self, ext) -> None:
            level = levels[ext.name]
            cached = native.cache_root() / native.level_key(level)
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            with native.build_lock(cached):  # a start or another build making this key: wait, take its build
                if self._build_or_reuse(ext, level, cached, target):
                    self.built.append(level)

        def _build_or_reuse(self, ext, level, cached: Path, target: Path) -> bool:
            found = native._library(cached)
            if found is not None:
                print(f"setup.py: native kernels {level.name}: from the cache {cached}", file=sys.stderr)
                shutil.copy2(found, target)
            else:
                print(f"setup.py: compiling native kernels for {level.name} ({len(ext.sources)} units)",
                      file=sys.stderr)
                try:
                    with native.build_progress(Path(self.build_temp), level.name, _say), native.parallel_jobs():
                        super().build_extension(ext)
                except Exception as e:  # noqa: BLE001 - no compiler (a CUDA image): install all the same
                    print(f"setup.py: native kernels for {level.name} not built ({type(e).__name__}: {e}); lmserve "
                          "compiles them at first use where it can, else uses the PyTorch paths", file=sys.stderr)
                    return False
                _keep(target, cached)
            return True

        def run(self) -> None:
            self.built = []  # the levels built or copied from the cache (a failed one is left out)
            _say(f"native kernels to build: {', '.join(lv.name for lv in levels.values())}")
            super().run()
            stamp = Path(self.get_ext_fullpath(next(iter(levels)))).parent / "_native_build.json"
            stamp.write_text(json.dumps({lv.name: native.level_key(lv) for lv in self.built}, indent=1) + "\n")

        def get_outputs(self) -> list[str]:  # the built libraries and the stamp go into the wheel
            built = {f"{PACKAGE}.{lv.module}" for lv in self.built}
            outputs = [self.get_ext_fullpath(e.name) for e in self.extensions if e.name in built]
            return outputs + [str(Path(outputs[0]).parent / "_native_build.json")] if outputs else outputs

    return exts, {"build_ext": BuildLevels.with_options(no_python_abi_suffix=False)}


def _say(line: str) -> None:
    print("setup.py: " + line, file=sys.stderr, flush=True)


def _keep(built: Path, cached: Path) -> None:
    """Copy a new build into the run-time cache (renamed into place whole, as native._compile does)."""
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, tmp / built.name)
        tmp.rename(cached)
    except OSError:  # a read-only home, or another build won: the package has its copy either way
        shutil.rmtree(tmp, ignore_errors=True)


ext_modules, cmdclass = extensions_and_commands()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
