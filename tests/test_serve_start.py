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
