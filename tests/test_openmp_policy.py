"""`import lmserve` makes idle OpenMP threads sleep (benchmarks/results/busy_neighbour.md) and bounds oneDNN's shape
caches, unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, lmserve; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize("user_env,expected", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                               ({"GOMP_SPINCOUNT": "10000"}, "None")])
def test_wait_policy_defaults_to_passive_and_respects_the_user(user_env, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    p = subprocess.run([sys.executable, "-c", PROBE], env={**env, **user_env}, capture_output=True, text=True,
                       timeout=60, check=True)
    assert p.stdout.strip() == expected


@pytest.mark.parametrize("user_env,expected", [({}, "256 256"), ({"LRU_CACHE_CAPACITY": "1024"}, "256 1024")])
def test_onednn_shape_caches_are_bounded_unless_the_user_chose(user_env, expected):
    probe = "import os, lmserve; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    p = subprocess.run([sys.executable, "-c", probe], env={**env, **user_env}, capture_output=True, text=True,
                       timeout=60, check=True)
    assert p.stdout.strip() == expected


@pytest.mark.parametrize("probe,user_env,expected", [
    ("import torch, lmserve", {}, "True"),  # libgomp read no policy when torch loaded it: it spins
    ("import lmserve, torch", {}, "False"),
    ("import torch, lmserve", {"OMP_WAIT_POLICY": "ACTIVE"}, "False"),  # the user's choice: nothing to say
])
def test_torch_imported_first_is_recorded(probe, user_env, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = f"{probe}; from lmserve.config import TORCH_FIRST_SPINS; print(TORCH_FIRST_SPINS)"
    p = subprocess.run([sys.executable, "-c", code], env={**env, **user_env}, capture_output=True, text=True,
                       timeout=60, check=True)
    assert p.stdout.strip() == expected


def test_a_cpu_engine_says_once_that_torchs_threads_spin_when_torch_came_first():
    """Two engines in a process that imported torch first: one warning naming the fix; none where lmserve came first
    (the offline LLM's users import torch first often; those threads took 1.2-1.6x of a 2-core decode step)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for first, count in (("torch", 1), ("lmserve", 0)):
        code = (f"import {first}\nfrom lmserve import LLM\n"
                "for _ in range(2):\n    LLM(max_num_seqs=1, max_model_len=64)\n")
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stderr.count("torch was imported before lmserve") == count, p.stderr[-2000:]
        if count:
            assert "OMP_WAIT_POLICY=PASSIVE" in p.stderr
