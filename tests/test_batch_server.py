"""/v1/files and /v1/batches against the real server, driven by the official openai client, restart included."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.server_util import MODEL, running_server

KEY = "batch-key"


def chat_line(cid: str, content: str, max_tokens: int = 8) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0}}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def client_for(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout: float = 180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch never got there: {batch}")


def lines_of(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_openai_client_batch_flow(tmp_path):
    rows = [chat_line("paris", "What is the capital of France?"), chat_line("two", "What is 1 + 1?"),
            {**chat_line("zero", "hi"), "body": {**chat_line("zero", "hi")["body"], "max_tokens": 0}},
            {"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL}}]
    keys = tmp_path / "keys.json"  # two named keys: objects belong to a key's name (each plain key has its own)
    keys.write_text(json.dumps({"keys": [{"name": "alice", "key": KEY}, {"name": "bob", "key": "other-key"}]}))
    # float weights: the chat line's "Paris" (the Q4_1 file with int8 activations answers as llama.cpp does)
    with running_server("--api-key-file", str(keys), "--batch-dir", str(tmp_path / "batches"),
                        "--quantization", "none") as s:
        client = client_for(s)
        uploaded = client.files.create(file=("requests.jsonl", jsonl(rows)), purpose="batch")
        assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(jsonl(rows)), "requests.jsonl")
        assert client.files.retrieve(uploaded.id).id == uploaded.id
        assert client.files.content(uploaded.id).read() == jsonl(rows)
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"run": "test"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "test"}
        batch = wait_for(client, batch.id, lambda b: b.status == "completed")
        assert batch.request_counts.model_dump() == {"total": 4, "completed": 2, "failed": 2}
        ok = {r["custom_id"]: r for r in lines_of(client, batch.output_file_id)}
        assert set(ok) == {"paris", "two"}
        assert "Paris" in ok["paris"]["response"]["body"]["choices"][0]["message"]["content"]
        failed = {r["custom_id"]: r for r in lines_of(client, batch.error_file_id)}
        assert failed["zero"]["response"]["status_code"] == 400
        assert failed["zero"]["response"]["body"]["error"]["param"] == "max_tokens"
        assert "/v1/chat/completions" in failed["wrong-url"]["error"]["message"]  # the job's endpoint only
        assert [b.id for b in client.batches.list()] == [batch.id]
        assert client.batches.cancel(batch.id).status == "completed"  # nothing left to cancel
        # Another key sees none of it
        other = client_for(s, "other-key")
        assert list(other.batches.list()) == []
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(batch.output_file_id)
        # Refusals in OpenAI's shape
        with pytest.raises(openai.NotFoundError):
            client.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        with pytest.raises(openai.BadRequestError):
            client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
        bad = httpx.post(s.url + "/v1/files", headers={"Authorization": f"Bearer {KEY}",
                                                      "Content-Type": "multipart/form-data; boundary=zz"},
                         content=b"--zz\r\ngarbage")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert client.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)


def test_cancel_stops_a_running_job_and_keeps_what_finished(tmp_path):
    rows = [chat_line(f"r{i}", f"Count from {i} to {i + 30}.", 32) for i in range(12)]
    with running_server("--max-num-seqs", "2", "--batch-dir", str(tmp_path)) as s:
        client = client_for(s)
        batch = client.batches.create(input_file_id=client.files.create(file=("in.jsonl", jsonl(rows)),
                                                                       purpose="batch").id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(client, batch.id, lambda b: b.request_counts.completed >= 1)
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        batch = wait_for(client, batch.id, lambda b: b.status == "cancelled", 30)
        done = lines_of(client, batch.output_file_id)
        assert 1 <= len(done) == batch.request_counts.completed < len(rows)
        s.wait_idle()  # the lines in flight were aborted: every KV block is back


@pytest.mark.slow
def test_a_job_survives_a_server_restart(tmp_path):
    """SIGTERM mid-job: the restarted server resumes it; every custom_id ends in the output exactly once."""
    ids = [f"r{i}" for i in range(10)]
    rows = [chat_line(cid, f"Count from {i} to {i + 30}.", 32) for i, cid in enumerate(ids)]
    args = ("--max-num-seqs", "2", "--batch-dir", str(tmp_path), "--drain-timeout", "1")
    with running_server(*args) as s:
        client = client_for(s)
        file_id = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        before = wait_for(client, batch.id, lambda b: b.request_counts.completed >= 2)
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=60)
    assert before.request_counts.completed < len(ids)
    with running_server(*args) as s:
        client = client_for(s)
        assert client.files.retrieve(file_id).bytes == len(jsonl(rows))
        batch = wait_for(client, batch.id, lambda b: b.status == "completed")
        results = lines_of(client, batch.output_file_id)
        assert Counter(r["custom_id"] for r in results) == Counter(ids)
        assert batch.request_counts.model_dump() == {"total": len(ids), "completed": len(ids), "failed": 0}
        assert batch.error_file_id is None
