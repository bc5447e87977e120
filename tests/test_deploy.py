"""The Grafana dashboard and Prometheus config cannot rot: every metric they name is served by a real server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import yaml

from tests.server_util import MODEL, running_server

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def served_names(text: str) -> set[str]:
    """Sample names a Prometheus query can use: families from # TYPE lines, with their series suffixes."""
    names = set()
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\w+)", line)
        if m:
            name, kind = m.groups()
            names.add(name)
            names |= {name + s for s in {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(kind, ())}
    return names


def test_dashboard_metrics_exist_on_a_server_with_every_ops_feature(tmp_path):
    dashboard = json.loads((DEPLOY / "grafana" / "lmserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"lmserve:[a-z0-9_]+", e)}
    assert len(wanted) > 25
    with running_server("--payload-log", str(tmp_path / "p.jsonl"), "--validation-rules",
                        str(DEPLOY / "rules.example.yaml"), "--drift-capture", "1") as s:
        openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=2, user="me")
        served = served_names(httpx.get(s.url + "/metrics").text)
    assert not wanted - served, f"dashboard names metrics the server does not serve: {sorted(wanted - served)}"


def test_prometheus_config_scrapes_metrics():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = cfg["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
