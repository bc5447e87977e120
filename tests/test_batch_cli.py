"""`lmserve run-batch` as a user runs it: the real command on the embedded model, killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from lmserve.server.batch.lines import DuplicateCustomId, ResultsFile, read_lines
from tests.test_cli_errors import assert_one_line_error, lmserve

MODEL = "SmolLM2-135M-Instruct"
SMALL = ["--kv-cache-memory", str(64 * 2**20), "--num-threads", "2", "--log-level", "warning"]


def chat_line(cid: str, content: str, max_tokens: int = 8) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0}}


def kill_after_lines(cmd: list[str], out: Path, lines: int, timeout: float, env: dict | None = None) -> None:
    """Run the batch job `cmd` and SIGKILL it once `out` holds at least `lines` lines (a crash part-way through);
    it must still be running then."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= lines:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_batch(*args: str) -> subprocess.CompletedProcess:
    # float weights: the Q4_1 file with int8 activations (the default) does not answer "Paris" to the chat line,
    # as llama.cpp does not on the same file
    return lmserve("--log-level", "warning", "run-batch", "--quantization", "none", *args, *SMALL[:4])


def test_good_and_bad_lines_each_get_their_result(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        chat_line("paris", "What is the capital of France?"),
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}},
        {"custom_id": "bad-param", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "hi", "max_tokens": 0}},
        {"custom_id": "unknown-field", "method": "POST", "url": "/v1/chat/completions",
         "body": {**chat_line("x", "hi")["body"], "frobnicate": 1}},
        {"custom_id": "other-model", "method": "POST", "url": "/v1/chat/completions",
         "body": {**chat_line("x", "hi")["body"], "model": "gpt-4o"}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        "{not json",
    ])
    out = tmp_path / "out.jsonl"
    # --strict-fields: the unknown field is refused as `serve --strict-fields` refuses it (ignored by default)
    p = run_batch("-i", str(src), "-o", str(out), "--summary", str(tmp_path / "summary.json"), "--strict-fields")
    assert p.returncode == 0, p.stderr[-3000:]
    by_id = {r["custom_id"]: r for r in results(out)}
    assert len(by_id) == 7
    ok = by_id["paris"]["response"]
    assert ok["status_code"] == 200 and by_id["paris"]["error"] is None
    assert "Paris" in ok["body"]["choices"][0]["message"]["content"] and ok["request_id"] == ok["body"]["id"]
    assert by_id["text"]["response"]["body"]["object"] == "text_completion"
    # Refusals carry the status and OpenAI-shaped body the HTTP route answers
    bad = by_id["bad-param"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens"
    assert by_id["unknown-field"]["response"]["body"]["error"]["code"] == "unsupported_field"
    assert by_id["other-model"]["response"]["status_code"] == 404
    assert by_id["other-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    # Lines that are no request at all are `error` lines
    assert by_id["bad-url"]["response"] is None and "/v1/embeddings" in by_id["bad-url"]["error"]["message"]
    assert by_id[None]["line"] == 7 and "not valid JSON" in by_id[None]["error"]["message"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["completed"], summary["failed"], summary["skipped"]) == (2, 5, 0)
    assert "2 completed, 5 failed" in p.stderr
    # A rerun finds every line answered and loads no model
    again = run_batch("-i", str(src), "-o", str(out))
    assert again.returncode == 0 and "all 7 requests already have results" in again.stderr
    assert len(results(out)) == 7


def test_duplicate_custom_ids_are_refused_before_anything_runs(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi"), chat_line("b", "hi"), chat_line("a", "yo")])
    out = tmp_path / "out.jsonl"
    p = run_batch("-i", str(src), "-o", str(out))
    assert_one_line_error(p, "custom_id 'a'", "lines 1 and 3")
    assert not out.exists()


def test_missing_input_file_and_bad_concurrency_are_one_line(tmp_path):
    assert_one_line_error(run_batch("-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl")),
                          "does not exist")
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    assert_one_line_error(run_batch("-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--max-concurrency", "0"),
                          "--max-concurrency")


@pytest.mark.slow  # two model loads and a real job: ~35 s on 2 shared cores
def test_sigkill_mid_job_then_rerun_gives_every_custom_id_exactly_once(tmp_path):
    """Killed while requests run (and with a torn half line at the end), the rerun fills in only what is missing."""
    ids = [f"req-{i}" for i in range(16)]
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line(cid, f"Count from {i} to {i + 20}.", 24)
                                              for i, cid in enumerate(ids)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "lmserve.cli", "--log-level", "warning", "run-batch", "-i", str(src), "-o", str(out),
           "--max-num-seqs", "2", *SMALL[:4]]
    kill_after_lines(cmd, out, 3, timeout=240)
    first = results(out)
    assert 3 <= len(first) < len(ids)
    with open(out, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"id": "batch_req_x", "custom_id": "req-15", "response": {"status_')
    p = run_batch("-i", str(src), "-o", str(out), "--max-num-seqs", "2", "--summary", str(tmp_path / "s.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    final = results(out)  # json.loads of every line: the torn one is gone
    assert Counter(r["custom_id"] for r in final) == Counter(ids)
    assert all(r["response"]["status_code"] == 200 for r in final)
    assert final[:len(first)] == first  # earlier results untouched
    assert json.loads((tmp_path / "s.json").read_text())["skipped"] == len(first)


def test_read_lines_refuses_duplicates_and_keeps_bad_lines():
    ok = json.dumps(chat_line("a", "hi")).encode()
    lines = read_lines([ok, b"", b"[1, 2]", json.dumps({**chat_line("b", "hi"), "url": "/v1/completions"}).encode()],
                       endpoint="/v1/chat/completions")
    assert [(line.number, line.custom_id, line.problem is None) for line in lines] == [
        (1, "a", True), (3, None, False), (4, "b", False)]
    assert "url must be /v1/chat/completions" in lines[2].problem
    with pytest.raises(DuplicateCustomId, match="lines 1 and 2"):
        read_lines([ok, ok])


def test_results_file_cuts_a_torn_tail_and_counts_what_it_holds(tmp_path):
    path = tmp_path / "r.jsonl"
    good = {"id": "1", "custom_id": "a", "response": {"status_code": 200}, "error": None}
    bad = {"id": "2", "custom_id": None, "line": 4, "response": None, "error": {"message": "x"}}
    path.write_bytes((json.dumps(good) + "\n" + json.dumps(bad) + "\n").encode() + b'{"id": "3", "cus')
    r = ResultsFile(path)
    assert r.done == {"a", "#line 4"} and r.counts == {"completed": 1, "failed": 1}
    r.append({**good, "custom_id": "b"})
    r.close()
    assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == ["a", None, "b"]
