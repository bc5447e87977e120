"""ruff over the whole tree with pyproject.toml's rules (pyflakes and import order): a finding fails the suite."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: it is in the `test` extra (scripts/install.sh test)")
    done = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
