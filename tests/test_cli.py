"""`lmserve generate` and `lmserve chat` as a user runs them: real processes on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

SMALL = ["--kv-cache-memory", str(64 * 2**20), "--num-threads", "2", "--temperature", "0"]


def lmserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("quant", [[], ["--quantization", "int4"]], ids=["float", "int4"])
def test_generate_streams_a_greedy_completion(quant):
    p = lmserve("--log-level", "info", "generate", "The capital of France is", "--max-tokens", "8", *SMALL, *quant)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Paris" in p.stdout
    assert ("int4 weights" in p.stderr) == bool(quant)  # the load log says what runs


def test_chat_streams_replies_until_exit():
    p = lmserve("chat", "--max-tokens", "12", *SMALL, stdin="What is the capital of France?\n\n/exit\n")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("you> ") == 3  # the empty line is skipped, /exit ends the loop
    assert "assistant> " in p.stdout and "Paris" in p.stdout


def test_bad_quantization_flag_is_refused_by_the_parser():
    p = lmserve("generate", "hi", "--quantization", "int3")
    assert p.returncode == 2 and "invalid choice: 'int3'" in p.stderr


def test_generate_with_a_json_schema_file(tmp_path):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
              "required": ["city", "population"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    p = lmserve("generate", "Describe Paris as JSON.", "--chat-template", "--json-schema", str(path),
                "--max-tokens", "60", *SMALL)
    assert p.returncode == 0, p.stderr[-2000:]
    jsonschema.validate(json.loads(p.stdout), schema)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    p = lmserve("generate", "hi", "--json-schema", str(bad), "--max-tokens", "4", *SMALL)
    assert p.returncode == 2 and 'Unsupported type "objekt"' in p.stderr and "Traceback" not in p.stderr
