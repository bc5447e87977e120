"""`lmserve serve` checks its port and host before any model loads, and no exit path aborts in C++."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.server_util import BASE_ARGS, free_port

ABORT = "terminate called"  # libstdc++'s message when a process exits with a C++ thread still running


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", *BASE_ARGS, "--log-level", "info", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_port_in_use_is_one_line_and_exit_2_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = serve("--port", str(port))
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("lmserve: error:")]
    assert errors == [f"lmserve: error: port {port} is in use (127.0.0.1:{port}: Address already in use); stop "
                      "what holds it or choose another with --port"], out
    assert "loading model" not in out and ABORT not in out and "Traceback" not in out


@pytest.mark.parametrize("host,message", [("203.0.113.7", "not an address of this machine"),
                                          ("no-such-host.invalid", "--host no-such-host.invalid")])
def test_a_host_that_cannot_be_listened_on_is_one_line(host, message):
    proc = serve("--host", host, "--port", str(free_port()))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and message in out and "loading model" not in out and ABORT not in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_load_exits_cleanly(sig):
    """Stopped while the model loads: exit 0 (a stop asked for), no C++ abort (was exit 134)."""
    proc = serve("--port", str(free_port()))
    lines = []
    deadline = time.time() + 300
    for line in proc.stdout:  # until the load has begun
        lines.append(line)
        if "loading model" in line or time.time() > deadline:
            break
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 0, out
    assert ABORT not in out and "Traceback" not in out, out


def test_sigint_default_handler_for_children():
    """The child of a test that sends Ctrl-C must not inherit an ignored SIGINT (a shell's `cmd &` gives one)."""
    from tests.server_util import default_sigint

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=default_sigint,
                             env=os.environ, timeout=60).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, old)
    assert out == "True"


def connect_then(port: int, proc: subprocess.Popen, timeout: float = 300) -> float:
    """Wait until the port accepts a connection (the process still running); the monotonic time it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return time.monotonic()
        except OSError:
            time.sleep(0.005)
    raise AssertionError("the port never opened")


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return out


def test_health_says_loading_until_the_model_is_up_then_ok():
    """The port opens before torch is imported (server/start.py): the first /health is 503 `loading`, then 200."""
    import httpx

    port = free_port()
    proc = serve("--port", str(port))
    try:
        connect_then(port, proc)
        first = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert first.status_code == 503 and first.json()["status"] == "loading", first.text
        assert first.json()["error"] == {"code": 503, "message": "Loading model", "type": "unavailable_error"}
        seen = [first.status_code]
        deadline = time.monotonic() + 300
        while seen[-1] != 200 and time.monotonic() < deadline:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
            seen.append(r.status_code)
            assert r.status_code in (200, 503) and r.json()["status"] in ("ok", "loading"), r.text
            time.sleep(0.02)
        assert seen[-1] == 200 and r.json() == {"status": "ok"}
    finally:
        out = stop(proc)
    assert proc.returncode == 0 and ABORT not in out and "Traceback" not in out, out


def test_a_chat_sent_the_moment_the_port_opens_gets_its_answer():
    """A client that starts the server and sends at once (no retries: a 503 would fail the test) is answered when the
    model is up, with the same tokens as a chat sent once the server is ready."""
    import openai

    port = free_port()
    proc = serve("--port", str(port))
    try:
        connect_then(port, proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": 8, "temperature": 0}
        stream = client.chat.completions.create(**body, stream=True)
        early = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        later = client.chat.completions.create(**body).choices[0].message.content
        assert early and early == later
    finally:
        out = stop(proc)
    assert proc.returncode == 0 and ABORT not in out, out


def test_a_load_that_fails_answers_the_waiting_request_and_exits_1(tmp_path):
    """A model whose header passes the checks but whose load fails (a tensor missing): the request waiting for it gets
    503 in its family's body at once, and the process exits 1 (as before the port opened early)."""
    import httpx

    from tests import bad_files as bf

    model = tmp_path / "missing-tensor.gguf"
    model.write_bytes(bf.gguf_bytes(bf.tiny_meta(), [t for t in bf.tiny_tensors() if t[0] != "blk.0.ffn_down.weight"]))
    port = free_port()
    proc = serve("--port", str(port), "--model", str(model), "--kv-cache-memory", str(64 * 2**20))
    try:
        connect_then(port, proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"], r.text
    finally:
        out = stop(proc)
    assert proc.returncode == 1 and "model load failed" in out and ABORT not in out, out


def test_a_refused_model_is_still_one_line_and_exit_2_after_the_port_opened(tmp_path):
    """prepare() runs behind the open port now: a bad model is still the CLI's one line and exit 2, uvicorn's start
    lines dropped, and a request that was waiting gets 503."""
    import httpx

    model = tmp_path / "notes.gguf"
    model.write_text("not a model\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", *BASE_ARGS, "--log-level", "info", "--port",
                             str(port), "--model", str(model)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        connect_then(port, proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=300)
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"], r.text
    except httpx.TransportError:
        pass  # the process was already on its way out: the exit below is what this test is about
    finally:
        out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("lmserve: error:"), err
    assert "notes.gguf" in lines[0] and "not a GGUF file" in lines[0] and "startup complete" not in out + err, err
