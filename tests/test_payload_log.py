"""Payload log: lines parse, redaction, sampling, field caps, rotation, nothing lost on close or graceful shutdown."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lmserve.ops.payload_log import PayloadLogger
from lmserve.ops.record import OutputRecord, RequestRecord
from tests.server_util import MODEL, running_server


def record(i: int = 0, prompt: str = "hello", text: str = "world") -> RequestRecord:
    r = RequestRecord(f"cmpl-{i}", "/v1/completions", model=MODEL, params={"max_tokens": 4, "temperature": 0.5},
                      prompt=prompt, prompt_tokens=3, status=200, e2e_s=0.5, queue_s=0.01)
    r.outputs.append(OutputRecord(text, 4, "length", -2.0))
    return r


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_parse_with_every_field(tmp_path):
    log = PayloadLogger(tmp_path / "p.jsonl")
    log.submit(record(1))
    log.close()
    (line,) = lines(tmp_path / "p.jsonl")
    assert line["request_id"] == "cmpl-1" and line["model"] == MODEL and line["route"] == "/v1/completions"
    assert line["params"] == {"max_tokens": 4, "temperature": 0.5} and line["prompt"] == "hello"
    assert line["outputs"][0] == {"text": "world", "tokens": 4, "finish_reason": "length", "cumulative_logprob": -2.0}
    assert line["prompt_tokens"] == 3 and line["output_tokens"] == 4 and line["mean_logprob"] == -0.5
    assert line["status"] == 200 and line["e2e_s"] == 0.5 and "time" in line and "trace_id" in line


def test_redaction_default_and_custom(tmp_path):
    log = PayloadLogger(tmp_path / "p.jsonl", redact=list(__import__("lmserve.ops.payload_log").ops.payload_log
                                                          .DEFAULT_REDACTIONS) + [r"\b\d{3}-\d{2}-\d{4}\b"])
    r = record(prompt="mail me at jane.doe@example.com, key sk-abcdefghijklmnopqrstuvwx, ssn 123-45-6789",
               text="Sure, bob@corp.io. Authorization: Bearer abcdefgh12345678")
    r.messages = [{"role": "user", "content": "my address is x@y.org"}]
    r.params = {"user": "ann@ex.com", "api_key": "should-never-appear", "max_tokens": 4}
    log.submit(r)
    log.close()
    text = (tmp_path / "p.jsonl").read_text()
    for secret in ("jane.doe@example.com", "sk-abcdefghijklmnopqrstuvwx", "123-45-6789", "bob@corp.io",
                   "abcdefgh12345678", "x@y.org", "ann@ex.com", "should-never-appear", "api_key"):
        assert secret not in text, secret
    line = json.loads(text)
    assert line["prompt"] == "mail me at [REDACTED], key [REDACTED], ssn [REDACTED]"
    assert line["params"]["max_tokens"] == 4


def test_sampling(tmp_path):
    for rate, expected in ((0.0, 0), (1.0, 200)):
        log = PayloadLogger(tmp_path / f"p{rate}.jsonl", sample_rate=rate)
        for i in range(200):
            log.submit(record(i))
        log.close()
        assert len(lines(tmp_path / f"p{rate}.jsonl")) == expected
    reg = CollectorRegistry()
    log = PayloadLogger(tmp_path / "p.jsonl", sample_rate=0.3, seed=7, registry=reg)
    for i in range(2000):
        log.submit(record(i))
    log.close()
    n = len(lines(tmp_path / "p.jsonl"))
    assert 500 < n < 700  # 600 expected; 4 standard deviations is about +-82
    metrics = generate_latest(reg).decode()
    assert f"lmserve:payload_log_lines_written_total {float(n)}" in metrics
    assert f'lmserve:payload_log_lines_dropped_total{{reason="sampled_out"}} {float(2000 - n)}' in metrics


def test_field_cap(tmp_path):
    log = PayloadLogger(tmp_path / "p.jsonl", max_field_chars=50)
    r = record(prompt="x" * 1000)
    r.prompt_tokens = 1000
    log.submit(r)
    ids = record(2)
    ids.prompt = list(range(300))
    log.submit(ids)
    log.close()
    a, b = lines(tmp_path / "p.jsonl")
    assert a["prompt"] == "x" * 50 + "...[truncated 950 chars]"
    assert b["prompt"][:50] == list(range(50)) and b["prompt"][50] == "...[truncated 250 items]"


def test_rotation_keeps_every_line_whole(tmp_path):
    path = tmp_path / "p.jsonl"
    log = PayloadLogger(path, max_bytes=4000, backups=100)
    for i in range(300):
        log.submit(record(i, text="t" * (i % 50)))
    log.close()
    files = [path] + sorted(tmp_path.glob("p.jsonl.*"), key=lambda p: int(p.suffix[1:]))
    assert len(files) > 5
    assert all(f.stat().st_size <= 4000 for f in files)
    ids = [line["request_id"] for f in reversed(files) for line in lines(f)]  # oldest file first
    assert ids == [f"cmpl-{i}" for i in range(300)]


def test_rotation_drops_beyond_backups(tmp_path):
    path = tmp_path / "p.jsonl"
    log = PayloadLogger(path, max_bytes=2000, backups=2)
    for i in range(200):
        log.submit(record(i))
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "p.jsonl.1", "p.jsonl.2"]
    last = [line["request_id"] for f in (path.with_name("p.jsonl.2"), path.with_name("p.jsonl.1"), path)
            for line in lines(f)]
    assert last == [f"cmpl-{i}" for i in range(200 - len(last), 200)]  # the newest lines, in order


def test_close_under_load_loses_nothing(tmp_path):
    log = PayloadLogger(tmp_path / "p.jsonl")

    def burst(t: int) -> None:
        for i in range(500):
            log.submit(record(t * 1000 + i))

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    ids = {line["request_id"] for line in lines(tmp_path / "p.jsonl")}
    assert len(ids) == 2000


def test_partial_last_line_leaves_the_rest_readable(tmp_path):
    path = tmp_path / "p.jsonl"
    log = PayloadLogger(path)
    for i in range(3):
        log.submit(record(i))
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"request_id": "cmpl-crash", "outp')  # what a crash mid-write would leave
    good = []
    for raw in path.read_text().splitlines():
        try:
            good.append(json.loads(raw)["request_id"])
        except json.JSONDecodeError:
            pass
    assert good == ["cmpl-0", "cmpl-1", "cmpl-2"]
    log = PayloadLogger(path)  # reopening appends after the partial line, on a line of its own
    log.submit(record(3))
    log.close()
    assert path.read_text().splitlines()[-1].startswith('{"request_id":"cmpl-3"')


@pytest.mark.parametrize("kwargs, match", [({"sample_rate": 1.5}, "sample rate"), ({"redact": ["("]}, "regex"),
                                           ({"max_bytes": 0}, "positive")])
def test_bad_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PayloadLogger(tmp_path / "p.jsonl", **kwargs)


def test_server_logs_every_request_through_graceful_shutdown(tmp_path):
    """20 concurrent requests, SIGTERM while they run: 20 lines, as the clients saw them, e-mail redacted."""
    path = tmp_path / "p.jsonl"
    # a generous drain: on an overloaded machine 20 requests can take longer than the default 30 s
    with running_server("--payload-log", str(path), "--max-num-seqs", "8", "--drain-timeout", "300") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)

        def one(i: int) -> tuple[str, str]:
            if i % 2:
                r = c.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": f"Write to ann{i}@mail.com"}])
                return r.id, r.choices[0].message.content
            if i % 4 == 0:
                chunks = list(c.completions.create(model=MODEL, prompt=f"Count {i}:", max_tokens=16, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
                return chunks[0].id, "".join(ch.choices[0].text for ch in chunks if ch.choices)
            r = c.completions.create(model=MODEL, prompt=f"Count {i}:", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
            return r.id, r.choices[0].text

        with ThreadPoolExecutor(20) as pool:
            futures = [pool.submit(one, i) for i in range(20)]
            s.wait_for_running(12)
            s.proc.send_signal(signal.SIGTERM)  # drain: in-flight requests finish, their lines must be written
            got, refused = {}, 0
            for f in futures:
                try:
                    got.update([f.result()])
                except openai.InternalServerError:  # arrived after SIGTERM: 503, logged as such
                    refused += 1
        assert s.proc.wait(60) == 0
    assert len(got) >= 12
    all_lines = lines(path)
    assert len(all_lines) == 20
    assert sum(line["status"] == 503 and "shutting down" in line["error"] for line in all_lines) == refused
    logged = {line["request_id"]: line for line in all_lines if line["status"] == 200}
    assert set(logged) == set(got)
    for rid, text in got.items():
        line = logged[rid]
        assert line["status"] == 200 and line["model"] == MODEL and line["prompt_tokens"] > 0
        assert line["outputs"][0]["text"] == text and line["output_tokens"] > 0, json.dumps(line)
        assert line["e2e_s"] > 0 and line["ttft_s"] is not None and line["mean_logprob"] < 0
        if rid.startswith("chatcmpl"):
            assert "[REDACTED]" in line["messages"][0]["content"] and "@mail.com" not in json.dumps(line)
