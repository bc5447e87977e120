"""A new user's first hour, on a fresh venv: the serve-only install, with no compiler, runs every command.

One venv for the whole module (it is the expensive part): this checkout's files are copied to a temporary
directory, `LMSERVE_NATIVE_LEVELS=all pip wheel` builds the wheel for distribution there (its native kernels
built once per instruction-set level, copied from the kernel cache when this machine built them before), and
`scripts/install.sh` installs it into a new venv exactly as its serve-only set-up does (torch 2.13.0 CPU, lmserve
with no extras, the embedded model), with LMSERVE_WHEEL naming the wheel. No --system-site-packages: a dependency missing from pyproject.toml fails here.
Every command then runs with no compiler to be found (PATH holds only the venv, CXX=false) and an empty kernel
cache, so the kernels can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.lora_adapters import write_random_adapter
from tests.server_util import default_sigint, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the fixture installs a venv: minutes

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [["serve"], ["generate"], ["chat"], ["run-batch"], ["pull"], ["list"], ["lora", "merge"],
            ["monitor", "profile"], ["bench", "serve"], ["bench", "latency"], ["bench", "throughput"],
            ["bench", "startup"], ["bench", "roofline"]]


def checkout_files() -> list[str]:
    """The working tree as git sees it: tracked files and untracked ones it does not ignore."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


class Fresh:
    """The fresh install and how to run its `lmserve`."""

    def __init__(self, root: Path, timings: dict) -> None:
        self.root, self.timings = root, timings
        self.bin = root / "src" / ".venv" / "bin"
        self.env = {"PATH": str(self.bin), "HOME": str(root / "home"), "CXX": "false", "CC": "false",
                    "LMSERVE_CACHE_DIR": str(root / "empty-cache"), "HF_HUB_OFFLINE": "1",
                    "HF_HUB_CACHE": str(root / "hub"), "XDG_DATA_HOME": str(root / "data"), "LANG": "C.UTF-8"}

    def run(self, *args: str, stdin: str = "", timeout: float = 600) -> subprocess.CompletedProcess:
        p = subprocess.run([str(self.bin / "lmserve"), *args], input=stdin, capture_output=True, text=True,
                           env=self.env, cwd=self.root, timeout=timeout)
        assert p.returncode == 0, f"lmserve {' '.join(args)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr and "terminate called" not in p.stderr, p.stderr[-3000:]
        return p


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Fresh:
    root = tmp_path_factory.mktemp("fresh")
    src, timings = root / "src", {}
    for name in checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "dist"), str(src)], check=True, timeout=3000,
                   env={**os.environ, "LMSERVE_NATIVE_LEVELS": "all"})  # a plain install builds the host's only
    timings["pip wheel (kernels from the cache where built before)"] = time.perf_counter() - start
    [wheel] = (root / "dist").glob("lmserve-*.whl")
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    # PIP_COMPILE=0: pip skips byte-compiling every installed module (torch, sympy, networkx...: ~6,000 files, most
    # never imported here; those the commands import are compiled on first import): ~40 CPU s of the install
    subprocess.run(["bash", "scripts/install.sh"], cwd=src, check=True, timeout=3000,
                   env={**env, "LMSERVE_WHEEL": str(wheel), "PIP_COMPILE": "0"})
    timings["scripts/install.sh into a new venv"] = time.perf_counter() - start
    (root / "empty-cache").mkdir()
    (root / "home").mkdir()
    yield Fresh(root, timings)
    print("\nfresh install:", json.dumps({k: round(v, 1) for k, v in timings.items()}))


def test_the_wheel_carries_a_build_for_each_level(fresh):
    import zipfile

    from lmserve.layers.kernels.native import LEVELS

    [wheel] = (fresh.root / "dist").glob("lmserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for level in LEVELS:
        assert any(n.startswith(f"lmserve/layers/kernels/{level.module}.") and n.endswith(".so") for n in names), level
    assert "lmserve/layers/kernels/_native_build.json" in names


def test_every_command_has_help_and_the_version(fresh):
    """One interpreter prints every command's --help (each its own parse, exit 0): a missing module fails it."""
    script = ("import sys\nfrom lmserve.cli import main\n"
              f"for argv in {COMMANDS!r}:\n"
              "    try:\n        main([*argv, '--help'])\n    except SystemExit as e:\n"
              "        assert e.code == 0, argv\n    print('==', *argv)\n")
    p = subprocess.run([str(fresh.bin / "python"), "-c", script], capture_output=True, text=True, env=fresh.env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert all(f"== {' '.join(c)}" in p.stdout for c in COMMANDS)
    assert fresh.run("--version").stdout.startswith("lmserve ")


def test_generate_uses_the_wheels_kernels_without_a_compiler(fresh):
    p = fresh.run("--log-level", "debug", "generate", "The capital of France is", "--max-tokens", "4",
                  "--temperature", "0")
    assert p.stdout.startswith(" Paris"), p.stdout
    assert "build, prebuilt" in p.stderr and "compiling native kernels" not in p.stderr, p.stderr[-3000:]
    assert "native CPU kernels unavailable" not in p.stderr


def test_chat_piped(fresh):
    p = fresh.run("chat", "--max-tokens", "8", "--temperature", "0", stdin="Hi!\n/exit\n")
    assert "assistant> " in p.stdout


def test_bench_latency_and_throughput(fresh):
    assert "TTFT" in fresh.run("bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-sizes", "1",
                               "--num-iters", "1").stdout
    out = json.loads(fresh.run("bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                               "--json").stdout)
    assert out


def test_run_batch_lora_merge_and_list(fresh, smol_path):
    from lmserve.loader import read_model_config

    requests = fresh.root / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0}}) + "\n")
    fresh.run("run-batch", "-i", str(requests), "-o", str(fresh.root / "results.jsonl"))
    [result] = [json.loads(line) for line in (fresh.root / "results.jsonl").read_text().splitlines()]
    assert result["response"]["status_code"] == 200
    adapter = write_random_adapter(fresh.root / "adapter", read_model_config(smol_path))
    out = fresh.run("lora", "merge", "--adapter", str(adapter), "--out", str(fresh.root / "merged")).stdout
    assert "merged" in out and (fresh.root / "merged" / "config.json").is_file()
    assert "(embedded)" in fresh.run("list").stdout


def test_serve_first_start_bench_serve_and_monitor(fresh):
    """The first `lmserve serve` on the fresh install: no compiler, first token timed (issue target: <= 10 s)."""
    port, payload = free_port(), fresh.root / "payload.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen([str(fresh.bin / "lmserve"), "serve", "--port", str(port), "--payload-log", str(payload)],
                            env=fresh.env, cwd=fresh.root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    try:
        text = _first_answer(url, proc)
        fresh.timings["first lmserve serve: start to first answer"] = time.perf_counter() - start
        assert text.startswith(" Paris"), text
        out = fresh.run("bench", "serve", "--base-url", url, "--num-prompts", "2", "--input-len", "8",
                        "--output-len", "4").stdout
        assert "tok/s" in out
    finally:
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log[-3000:]
    assert "compiling native kernels" not in log and "terminate called" not in log and "Traceback" not in log
    assert json.loads(fresh.run("monitor", "profile", str(payload)).stdout)


def _first_answer(url: str, proc: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                          "temperature": 0}, timeout=30)
            if r.status_code == 200:
                return r.json()["choices"][0]["text"]
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server never answered")
