"""What a loaded CPU model keeps resident: no torch._dynamo/triton import (153 MiB of RSS), measured in a fresh
process that loads the embedded model and serves one request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
from lmserve.config import CacheConfig, EngineConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams

eng = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), quantization=sys.argv[1] or None))
eng.add_request("a", "The sea is", SamplingParams(temperature=0.0, max_tokens=4))
ids = []
while eng.has_unfinished():
    ids += [t for d in eng.step() for t in d.token_ids]
print(json.dumps({"ids": ids, "dynamo": "torch._dynamo" in sys.modules, "triton": "triton" in sys.modules}))
"""


@pytest.mark.parametrize("quantization", ["gguf", ""])
def test_cpu_load_and_serve_never_import_dynamo(quantization):
    out = subprocess.run([sys.executable, "-c", SCRIPT, quantization], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["ids"]) == 4
    assert not got["dynamo"] and not got["triton"], got
