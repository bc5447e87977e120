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
