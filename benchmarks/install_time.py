"""How long a new user's install takes: cold `scripts/install.sh`, cold `pip install .`, and each kernel unit.

    python benchmarks/install_time.py --units HEAD~3 HEAD     # CPU seconds of g++ per translation unit, per ref
    python benchmarks/install_time.py --install --pip          # the two cold installs (minutes each)

--install: `bash scripts/install.sh` in a fresh clone of this checkout's HEAD (its own new .venv), with
LMSERVE_CACHE_DIR an empty directory, so the native kernels compile from nothing. --pip: `pip install .` from a
fresh clone into a new venv, with pip's build isolation (the build environment installs torch too). pip's own
package cache (or, where pip.conf names one, a local wheel directory) stays as it is: the times are the install
and the compile, not the download. Each reports wall seconds, the CPU seconds of everything it ran, and the load
average around it (other processes on a shared machine stretch the wall time, not the CPU time), with the
install's own progress lines.

--units: each kernel unit of the host's level compiled alone with the flags torch's cpp_extension uses, for each
git ref given (its layers/kernels/csrc/ as committed), reporting g++'s CPU seconds: the compile cost, not the machine's
load. Results: benchmarks/results/install_time.{json,md}, naming the CPU and its flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RESULTS = ROOT / "benchmarks" / "results"


def children_cpu() -> float:
    """User + system CPU seconds of every finished child process of this one so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd: list[str], **kw) -> dict:
    """Run `cmd` to the end; its wall and CPU seconds, the load average before and after, and its output."""
    load0, cpu0, t0 = os.getloadavg()[0], children_cpu(), time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_before": load0,
            "load_after": os.getloadavg()[0], "output": p.stdout + p.stderr}


def fresh_clone(root: Path) -> Path:
    """This checkout's HEAD, cloned without its build outputs."""
    dest = root / "lmserve"
    subprocess.run(["git", "clone", "-q", "--no-local", str(ROOT), str(dest)], check=True)
    return dest


def clean_env(root: Path) -> dict:
    """The caller's environment less any venv, with an empty kernel cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MAX_JOBS")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    (root / "kernel-cache").mkdir()
    env["LMSERVE_CACHE_DIR"] = str(root / "kernel-cache")
    return env


def progress(output: str) -> list[str]:
    """The install's kernel build lines (from where each starts: a compiler warning may precede one on its line)."""
    return [line[line.index("setup.py: "):] for line in output.splitlines() if "setup.py: " in line]


def cold_install_sh() -> dict:
    """`bash scripts/install.sh` in a fresh clone, empty kernel cache, new .venv."""
    with tempfile.TemporaryDirectory(prefix="lmserve-install-") as tmp:
        src = fresh_clone(Path(tmp))
        r = timed(["bash", "scripts/install.sh"], cwd=src, env=clean_env(Path(tmp)))
    return {**{k: v for k, v in r.items() if k != "output"}, "progress": progress(r["output"])}


def cold_pip_install() -> dict:
    """`pip install .` (build isolation) from a fresh clone into a new venv, empty kernel cache."""
    with tempfile.TemporaryDirectory(prefix="lmserve-pip-") as tmp:
        src, env = fresh_clone(Path(tmp)), clean_env(Path(tmp))
        subprocess.run([sys.executable, "-m", "venv", str(Path(tmp) / "venv")], check=True)
        r = timed([str(Path(tmp) / "venv" / "bin" / "pip"), "install", "-v", "--disable-pip-version-check", str(src)],
                  env=env)
    return {**{k: v for k, v in r.items() if k != "output"}, "progress": progress(r["output"])}


def compile_flags(level_march: tuple[str, ...]) -> list[str]:
    """g++ flags as torch's cpp_extension passes them for an extension unit of this level."""
    import torch.utils.cpp_extension as cpp

    from lmserve.layers.kernels import native

    includes = [f for p in [*cpp.include_paths(), sysconfig.get_paths()["include"]] for f in ("-isystem", p)]
    return ["-DTORCH_EXTENSION_NAME=_t", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, "-fPIC", "-std=c++20",
            *native.CFLAGS, *level_march, "-c"]


def unit_seconds(ref: str, flags: list[str]) -> dict[str, float]:
    """g++'s CPU seconds for each .cpp of layers/kernels/csrc/ as committed at `ref`, compiled one at a time."""
    with tempfile.TemporaryDirectory(prefix="lmserve-units-") as tmp:
        archive = subprocess.run(["git", "archive", ref, "src/lmserve/layers/kernels/csrc"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        csrc = Path(tmp) / "src/lmserve/layers/kernels/csrc"
        times = {}
        for unit in sorted(csrc.glob("*.cpp")):
            r = timed(["g++", *flags, str(unit), "-o", str(Path(tmp) / (unit.stem + ".o"))])
            times[unit.stem] = r["cpu_s"]
            print(f"{ref} {unit.stem}: {r['cpu_s']} CPU s ({r['wall_s']} s wall)", file=sys.stderr, flush=True)
    return times


def machine() -> dict:
    """The CPU, the level it builds, its cores and flags (the /proc/cpuinfo line)."""
    from lmserve.layers.kernels import native
    from lmserve.utils import cpu_flags

    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    level = native.pick_level(cpu_flags())
    return {"cpu": model, "level": level.name, "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "flags": cpu_flags().split(":", 1)[-1].strip()}


def report(results: dict) -> str:
    """The results as a markdown page."""
    m = results["machine"]
    lines = [f"# Install time ({results['date']})", "",
             f"CPU: {m['cpu']}, {m['cores']} cores, native level {m['level']}. Flags: `{m['flags']}`", ""]
    for name in ("install_sh", "pip_install"):
        if name in results:
            r = results[name]
            lines += [f"## {name}", "", f"{r['wall_s']} s wall, {r['cpu_s']} s CPU, load average {r['load_before']:.1f}"
                      f" before, {r['load_after']:.1f} after", "", "```", *r["progress"], "```", ""]
    if "units" in results:
        refs = list(results["units"])
        names = sorted({u for t in results["units"].values() for u in t})
        lines += ["## g++ CPU seconds per unit", "", "| unit | " + " | ".join(refs) + " |",
                  "|---|" + "---|" * len(refs)]
        lines += [f"| {u} | " + " | ".join(str(results["units"][r].get(u, "")) for r in refs) + " |" for u in names]
        lines += ["| total | " + " | ".join(f"{sum(results['units'][r].values()):.1f}" for r in refs) + " |", ""]
    return "\n".join(lines + [results.get("note", ""), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install", action="store_true", help="time a cold scripts/install.sh")
    ap.add_argument("--pip", action="store_true", help="time a cold pip install .")
    ap.add_argument("--units", nargs="*", metavar="REF", help="g++ CPU seconds per kernel unit at these git refs")
    ap.add_argument("--note", default="", help="a line for the report (the machine's load, what else ran)")
    ap.add_argument("--out", default="install_time", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    from lmserve.layers.kernels import native
    from lmserve.utils import cpu_flags

    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "note": args.note}
    if args.units:
        flags = compile_flags(native.pick_level(cpu_flags()).march)
        results["units"] = {ref: unit_seconds(ref, flags) for ref in args.units}
    if args.install:
        results["install_sh"] = cold_install_sh()
    if args.pip:
        results["pip_install"] = cold_pip_install()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
