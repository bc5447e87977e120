"""What a start says at INFO: a native-kernel build is announced and timed, a cached one is quiet, and the
skinny kernel's per-layer check is one summary line."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmserve.layers.formats import linear
from lmserve.layers.kernels import native
from lmserve.utils import cpu_flags
from lmserve.worker.transforms import load_formatted
from tests.conftest import LAYERS, write_tiny_llama


def fake_build(monkeypatch, tmp_path) -> list[str]:
    """Point the kernel cache at tmp_path; cpp_extension.load writes an empty library instead of compiling."""
    from torch.utils import cpp_extension

    builds: list[str] = []

    def load(name, sources, build_directory, **kw):
        builds.append(build_directory)
        (Path(build_directory) / "lmserve_native.so").write_bytes(b"")

    monkeypatch.setenv("LMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "BUILD_STAMP", tmp_path / "no-package-build.json")  # no build from pip install
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_import", lambda path: SimpleNamespace(path=path))
    return builds


def info_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_a_build_is_announced_and_timed_and_a_cached_load_is_quiet(monkeypatch, tmp_path, caplog):
    builds = fake_build(monkeypatch, tmp_path)
    with caplog.at_level(logging.DEBUG, logger="lmserve.layers.kernels.native"):
        assert native._build() is not None
    assert len(builds) == 1
    lines = info_lines(caplog)
    level = native.pick_level(cpu_flags())  # the fallback build is the level this CPU picks, as pip would ship it
    assert lines[0] == (f"compiling native kernels for {level.name} (no build of it for these sources and torch "
                        f"{torch.__version__} here yet; once) ...")
    assert lines[1].startswith("native kernels compiled in ") and lines[1].endswith(" s")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="lmserve.layers.kernels.native"):
        assert native._build() is not None
    assert len(builds) == 1  # the second start found the build
    assert info_lines(caplog) == [] and "loaded from" in caplog.text  # DEBUG only


needs_kernel = pytest.mark.skipif(native.native_module() is None, reason="no C++ compiler: no skinny kernel")


@needs_kernel
@pytest.mark.parametrize("refused", [0, 3])
def test_the_skinny_check_is_one_summary_line(monkeypatch, tmp_path, caplog, refused):
    write_tiny_llama(tmp_path / "tiny")
    layers = 4 * LAYERS + 1  # qkv, o, gate_up, down per decoder layer (fused), and the LM head
    if refused:  # the first `refused` layers checked differ from oneDNN, as on some CPUs
        check = linear.PackedLinear._skinny_matches_onednn
        seen: list[int] = []

        def matches(self, panels):
            seen.append(1)
            return len(seen) > refused and check(self, panels)

        monkeypatch.setattr(linear.PackedLinear, "_skinny_matches_onednn", matches)
    with caplog.at_level(logging.DEBUG):
        load_formatted(tmp_path / "tiny", torch.float32, torch.device("cpu"))
    skinny = [line for line in info_lines(caplog) if "skinny" in line]
    kept = f"; {refused} keep oneDNN (not bit-identical)" if refused else ""
    assert skinny == [f"skinny kernel: {layers - refused} of {layers} layers use it{kept}"]  # no per-layer lines
