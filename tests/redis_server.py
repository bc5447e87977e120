"""A real redis-server for tests: on a free loopback port, no persistence, stopped (killed) when the test is done."""

from __future__ import annotations

import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from tests.server_util import free_port


@dataclass
class RedisServer:
    """One redis-server process and its URL."""

    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def redis_server(port: int | None = None):
    """Start redis-server (on `port`, default a free one) and wait until it answers; skipped (naming the package)
    where it is not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; scripts/install.sh test installs it)")
    port = port or free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    server = RedisServer(proc, port)
    import redis

    client = server.client()
    deadline = time.time() + 30  # start-up, a bound and not a measurement
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.time() > deadline or proc.poll() is not None:
                server.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)
    try:
        yield server
    finally:
        server.kill()
