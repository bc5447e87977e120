"""Start the real server as a subprocess on a free port and talk to it over loopback."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx

MODEL = "SmolLM2-135M-Instruct"
BASE_ARGS = ["--kv-cache-memory", str(256 * 2**20), "--num-threads", "2", "--log-level", "warning"]


def default_sigint() -> None:
    """preexec_fn for a child that a test sends Ctrl-C: SIGINT's default handling, whatever this process has.

    A non-interactive shell starts background jobs (`bash .ci/run &`) with SIGINT ignored, every child inherits
    that, and Python installs no KeyboardInterrupt handler where SIGINT is ignored at start.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `lmserve serve` process."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"
        self.health_seen: list[int] = []  # /health statuses while starting (503 while the model loads)

    def metric(self, name: str, labels: str = "") -> float:
        """Value of a Prometheus sample from /metrics (labels as written, e.g. 'reason="shutdown"')."""
        text = httpx.get(self.url + "/metrics", timeout=10, headers=getattr(self, "headers", {})).text
        pattern = re.escape(name) + (r"\{[^}]*" + re.escape(labels) + r"[^}]*\}" if labels else r"(\{[^}]*\})?")
        m = re.search(r"^" + pattern + r" ([0-9.e+-]+)$", text, re.M)
        if m is None:
            raise KeyError(name)
        return float(m.groups()[-1])

    def wait_for_running(self, n: int, timeout: float = 60) -> None:
        """Until at least `n` generation requests are in flight."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.metric("lmserve:num_requests_in_flight") >= n:
                return
            time.sleep(0.02)
        raise AssertionError(f"{n} requests never were in flight")

    def wait_idle(self, timeout: float = 30) -> None:
        """Until every KV block is free again (all requests finished or aborted)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.metric("lmserve:kv_cache_free_blocks") == self.metric("lmserve:kv_cache_total_blocks"):
                return
            time.sleep(0.05)
        raise AssertionError("KV blocks were not all returned")


@contextmanager
def running_server(*extra: str, env: dict | None = None, headers: dict | None = None, start_timeout: float = 120,
                   module: str = "lmserve.cli"):
    """Start a server, wait for /health 200, yield it, then stop it (SIGKILL if SIGTERM does not do).

    Its user data dir (the playground's default share file) is a fresh temporary one unless `env` names one;
    `module`: the entry point run with `-m` (tests/serve_private_media.py wraps the CLI's).
    """
    port = free_port()
    cmd = [sys.executable, "-m", module, "serve", "--port", str(port), *BASE_ARGS, *extra]
    log = open(os.environ.get("LMSERVE_TEST_SERVER_LOG", os.devnull), "ab")
    data_home = tempfile.TemporaryDirectory(prefix="lmserve-data-")
    env = {**os.environ, "XDG_DATA_HOME": data_home.name, **(env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, port)
    server.headers = headers or {}
    try:
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} (set LMSERVE_TEST_SERVER_LOG to see why)")
            try:
                server.health_seen.append(httpx.get(server.url + "/health", timeout=2).status_code)
                if server.health_seen[-1] == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("server did not become healthy")
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        data_home.cleanup()


def unhealthy_within(url: str, seconds: float, start: float | None = None) -> bool:
    """/health answers 503 (or the server has stopped listening) within `seconds` of `start` (default: now)."""
    import httpx

    start = time.monotonic() if start is None else start
    while time.monotonic() - start < seconds:
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 503:
                return True
        except httpx.HTTPError:  # already closed its socket on the way out: not healthy either
            return True
        time.sleep(0.02)
    return False
