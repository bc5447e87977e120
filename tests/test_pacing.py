"""A key whose requests keep being refused waits while other keys are served (server/pacing.py): the bucket's
arithmetic on its own, then a real server with two keys, one sending bad requests back to back (the abuser), one
sending good ones (the tenant beside it), and the same abuser alone, which must never wait."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from lmserve.server.pacing import ACTIVE_S, RefusalPacer, counts_as_refused
from tests.server_util import running_server

KEYS = ("keys:\n  - name: a\n    key: sk-a-0123456789\n  - name: b\n    key: sk-b-0123456789\n"
        "  - name: ops\n    key: sk-ops-0123456789\n    role: admin\n")
A = {"Authorization": "Bearer sk-a-0123456789"}
B = {"Authorization": "Bearer sk-b-0123456789"}
OPS = {"Authorization": "Bearer sk-ops-0123456789"}  # /metrics
BAD = {"prompt": "hi", "max_tokens": -5}  # a 400 in OpenAI's shape, after the body is parsed
GOOD = {"prompt": "hi", "max_tokens": 1}


def test_statuses_that_count():
    assert all(counts_as_refused(s) for s in (400, 404, 413, 422))
    assert not any(counts_as_refused(s) for s in (200, 401, 403, 429, 500, 503))


def test_a_key_alone_never_waits_however_often_it_is_refused():
    p = RefusalPacer(10, 20)
    for i in range(200):
        assert p.arrive("a", i * 0.001) == 0
        p.answered("a", 400, i * 0.001)


def test_the_bucket_spends_its_burst_then_paces_at_its_rate_while_another_key_is_active():
    p, now = RefusalPacer(10, 20), 0.0
    p.arrive("b", now)
    for _ in range(20):  # the burst: no wait
        assert p.arrive("a", now) == 0
        p.answered("a", 400, now)
    assert p.arrive("a", now) == pytest.approx(0.1)  # one refusal's refill at 10 a second
    p.answered("a", 400, now)
    assert p.arrive("a", now) == pytest.approx(0.2)  # in debt
    for _ in range(100):
        p.answered("a", 400, now)
    assert p.arrive("a", now) == pytest.approx(2.1)  # the debt stops at -burst: a wait is at most (1 + burst) / rate
    # good answers take nothing; time refills it
    p.answered("a", 200, now)
    p.arrive("b", now + 1.0)
    assert p.arrive("a", now + 1.0) == pytest.approx(1.1)
    # the other key gone quiet for ACTIVE_S: no wait however deep the debt
    assert p.arrive("a", now + 1.0 + ACTIVE_S) == 0


def test_off():
    p = RefusalPacer(0, 0)
    p.arrive("b", 0)
    for _ in range(50):
        p.answered("a", 400, 0)
    assert p.arrive("a", 0) == 0


def _refusals(url: str, n: int) -> tuple[float, list[int]]:
    statuses, t = [], time.perf_counter()
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            statuses.append(c.post(url + "/v1/completions", json=BAD, headers=A).status_code)
    return time.perf_counter() - t, statuses


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("pacing") / "keys.yaml"
    keys.write_text(KEYS)
    with running_server("--api-key-file", str(keys), headers=OPS) as s:
        yield s


def test_the_abuser_waits_while_another_key_is_served_and_never_alone(server):
    # alone: 60 refusals back to back, none waits
    alone, statuses = _refusals(server.url, 60)
    assert statuses == [400] * 60
    assert server.metric("lmserve:key_requests_paced_total", 'key_name="a"') == 0

    stop, good = threading.Event(), []

    def tenant() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                good.append(c.post(server.url + "/v1/completions", json=GOOD, headers=B).status_code)

    t = threading.Thread(target=tenant)
    t.start()
    try:
        while not good:
            time.sleep(0.01)
        # beside key b: the burst (20) passes at once, the other 40 at about 10 a second
        beside, statuses = _refusals(server.url, 60)
    finally:
        stop.set()
        t.join()
    assert statuses == [400] * 60  # each still gets its own answer
    paced = server.metric("lmserve:key_requests_paced_total", 'key_name="a"')
    assert paced >= 30
    assert beside >= 3.0, f"60 refusals beside another key took {beside:.2f} s (alone: {alone:.2f} s)"
    assert set(good) == {200} and server.metric("lmserve:key_requests_paced_total", 'key_name="b"') == 0
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()


def test_pacing_off(tmp_path):
    (tmp_path / "keys.yaml").write_text(KEYS)
    with running_server("--api-key-file", str(tmp_path / "keys.yaml"), "--pace-refused-requests", "0",
                        headers=OPS) as s:
        with httpx.Client(timeout=30) as c:
            for _ in range(40):
                c.post(s.url + "/v1/completions", json=GOOD, headers=B)  # b active: within ACTIVE_S of each of a's
                assert c.post(s.url + "/v1/completions", json=BAD, headers=A).status_code == 400
        assert s.metric("lmserve:key_requests_paced_total", 'key_name="a"') == 0
