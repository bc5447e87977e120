"""Drift detection: features, PSI/KS against scipy, profiles, and a live server whose prompt lengths shift."""

from __future__ import annotations

import io
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lmserve.ops.drift import (
    FEATURES,
    DriftMonitor,
    build_profile,
    categorical_psi,
    features,
    ks_2samp,
    numeric_psi,
    profile_command,
    script_of,
)
from lmserve.ops.record import OutputRecord, RequestRecord
from tests.server_util import MODEL, running_server


def record(prompt_tokens: int, text: str = "hello world", status: int = 200, **params) -> RequestRecord:
    r = RequestRecord("r", "/v1/completions", params=params, prompt=text, prompt_tokens=prompt_tokens, status=status)
    r.outputs.append(OutputRecord("out", 4, "length", -2.0))
    return r


def test_features():
    f = features(record(7, "Hi 42, ok?", temperature=0.0, max_tokens=9, stop=["x"]).to_dict())
    assert f["prompt_tokens"] == 7 and f["output_tokens"] == 4 and f["mean_logprob"] == -0.5
    assert f["prompt_chars"] == 10 and f["frac_letters"] == 0.4 and f["frac_digits"] == 0.2
    assert f["frac_whitespace"] == 0.2 and f["frac_punct"] == 0.2 and f["frac_non_ascii"] == 0
    assert f["temperature"] == 0 and f["max_tokens"] == 9 and f["sampling"] == "greedy"
    assert f["finish_reason"] == "length" and f["uses_stop"] == "true" and f["stream"] == "false"
    chat = features({"route": "/v1/chat/completions", "messages": [{"role": "user", "content": "Привет мир"}],
                     "params": {}, "outputs": []})
    assert chat["script"] == "cyrillic_greek" and chat["sampling"] == "default" and "temperature" not in chat
    assert script_of("日本語のテキスト") == "cjk" and script_of("1234") == "none" and script_of("naïve") == "latin"
    assert set(f) | set(chat) <= set(FEATURES)


def test_psi_and_ks():
    rng = np.random.default_rng(0)
    ref = build_profile(record(int(n)).to_dict() for n in rng.normal(100, 15, 2000))
    same = numeric_psi(ref["numeric"]["prompt_tokens"], rng.normal(100, 15, 2000))
    shifted = numeric_psi(ref["numeric"]["prompt_tokens"], rng.normal(160, 15, 2000))
    assert same < 0.02 and shifted > 2
    assert categorical_psi({"a": 0.5, "b": 0.5}, ["a", "b"] * 50) == pytest.approx(0, abs=1e-9)
    assert categorical_psi({"a": 0.5, "b": 0.5}, ["c"] * 100) > 5  # unseen categories go to "other"
    scipy_stats = pytest.importorskip("scipy.stats")
    for shift in (0.0, 0.2, 1.0):
        x, y = rng.normal(0, 1, 300), rng.normal(shift, 1, 200)
        d, p = ks_2samp(x, y)
        ref_ks = scipy_stats.ks_2samp(x, y, method="asymp")
        assert d == pytest.approx(ref_ks.statistic, abs=1e-12)
        assert p == pytest.approx(ref_ks.pvalue, abs=0.02)


def test_profile_round_trip_and_monitor_report():
    rng = random.Random(1)
    ref = build_profile(record(rng.randint(5, 30)).to_dict() for _ in range(400))
    ref = json.loads(json.dumps(ref))
    registry = CollectorRegistry()
    mon = DriftMonitor(reference=ref, window=300, threshold=0.2, registry=registry)
    assert mon.report()["status"] == "insufficient_data"
    for _ in range(300):
        mon.observe(record(rng.randint(5, 30)))
    rep = mon.report()
    assert rep["status"] == "ok" and rep["features"]["prompt_tokens"]["psi"] < 0.2 and not rep["drifted"]
    for _ in range(300):
        mon.observe(record(rng.randint(60, 120)))
    mon.observe(record(500, status=400))  # failed requests never count
    rep = mon.report()
    f = rep["features"]["prompt_tokens"]
    assert rep["status"] == "drift" and "prompt_tokens" in rep["drifted"] and f["psi"] > 0.2 and f["drift"]
    assert f["ks_statistic"] == 1.0 and f["ks_pvalue"] < 1e-6 and f["window_mean"] > 60
    text = generate_latest(registry).decode()
    assert f'lmserve:drift_psi{{feature="prompt_tokens"}} {f["psi"]!r}' in text or \
        f'lmserve:drift_psi{{feature="prompt_tokens"}} {f["psi"]}' in text
    assert 'lmserve:drift_detected{feature="prompt_tokens"} 1.0' in text
    labels = {line.split('feature="')[1].split('"')[0] for line in text.splitlines() if 'feature="' in line}
    assert labels <= set(FEATURES)


def test_capture_mode():
    mon = DriftMonitor(capture=50, window=50, min_samples=50)
    for i in range(49):
        mon.observe(record(10 + i % 5))
    assert mon.report()["status"] == "capturing" and mon.report()["reference"]["samples"] == 49
    mon.observe(record(10))
    assert mon.report()["reference"] == {"source": "first 50 requests", "samples": 50}
    for i in range(50):
        mon.observe(record(10 + i % 5))
    assert mon.report()["features"]["prompt_tokens"]["psi"] < 0.01  # the same mix, one 10 more in the reference


@pytest.mark.parametrize("bad, match", [({"version": 9}, "version"), ({"version": 1, "numeric": {}}, "categorical"),
                                        ({"version": 1, "numeric": {"x": {"edges": []}}, "categorical": {}},
                                         "'sample'")])
def test_bad_reference(bad, match):
    with pytest.raises(ValueError, match=match):
        DriftMonitor(reference=bad)


def test_profile_command(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps(record(10 + i % 7).to_dict()) for i in range(30)]
    lines.append(json.dumps(record(999, status=500).to_dict()))
    path.write_text("\n".join(lines) + '\n{"request_id": "partial", "pro')
    out = io.StringIO()
    assert profile_command(str(path), out) == 0
    profile = json.loads(out.getvalue())
    assert profile["samples"] == 30 and max(profile["numeric"]["prompt_tokens"]["sample"]) == 16
    DriftMonitor(reference=profile)  # loads as a reference
    assert profile_command(str(tmp_path / "missing.jsonl"), io.StringIO()) == 2


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_server_flags_a_shift_in_prompt_lengths():
    """Reference = the first 200 requests; 200 more from the same distribution: no drift; 200 longer: drift.

    Prompts are seeded token-id lists, so the lengths (and so the PSI values) are the same on every run.
    """
    n = 200
    with running_server("--drift-capture", str(n), "--drift-window", str(n), "--drift-threshold", "0.2",
                        "--max-num-seqs", "16") as s, httpx.Client(base_url=s.url, timeout=60) as client:
        def send(prompts: list[list[int]]) -> None:
            def one(p):
                r = client.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 1})
                assert r.status_code == 200
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, prompts))

        send(_prompts(random.Random(1), n, 2, 12))
        assert client.get("/v1/monitoring/drift").json()["reference"]["samples"] == n
        send(_prompts(random.Random(2), n, 2, 12))  # same distribution, other draws
        same = client.get("/v1/monitoring/drift").json()["features"]["prompt_tokens"]
        assert same["psi"] < 0.2 and not same["drift"], same
        send(_prompts(random.Random(3), n, 20, 40))  # prompts 2-10x longer
        report = client.get("/v1/monitoring/drift").json()
        shifted = report["features"]["prompt_tokens"]
        assert shifted["psi"] > 0.2 and shifted["drift"] and "prompt_tokens" in report["drifted"]
        assert report["status"] == "drift"
        metrics = client.get("/metrics").text
        gauge = next(line for line in metrics.splitlines() if line.startswith('lmserve:drift_psi{feature="prompt_tokens"}'))
        assert float(gauge.split()[-1]) == pytest.approx(shifted["psi"])
        assert 'lmserve:drift_detected{feature="prompt_tokens"} 1.0' in metrics


def test_drift_endpoint_off_by_default(server):
    r = httpx.get(server.url + "/v1/monitoring/drift")
    assert r.status_code == 404 and "--drift-capture" in r.json()["error"]["message"]
