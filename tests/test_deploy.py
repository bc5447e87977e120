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


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "lmserve-dashboard.json").read_text())


def queries(d: dict) -> list[str]:
    """Every PromQL string: panel targets and templating variable queries."""
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    return exprs + [v["query"] for v in d["templating"]["list"] if v["type"] == "query"]


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
    wanted = {m for e in queries(dashboard()) for m in re.findall(r"lmserve:[a-z0-9_]+", e)}
    assert len(wanted) > 25
    with running_server("--payload-log", str(tmp_path / "p.jsonl"), "--validation-rules",
                        str(DEPLOY / "rules.example.yaml"), "--drift-capture", "1") as s:
        openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=2, user="me")
        served = served_names(httpx.get(s.url + "/metrics").text)
    assert not wanted - served, f"dashboard names metrics the server does not serve: {sorted(wanted - served)}"


def test_dashboard_is_importable():
    """Grafana-side shape: a Prometheus datasource variable used everywhere, unique ids, no overlapping panels."""
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        panel = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & panel, f"{p['title']} overlaps another panel"
        cells |= panel
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    for e in queries(d):  # a cheap syntax guard: brackets balance
        for open_, close in ("()", "{}", "[]"):
            assert e.count(open_) == e.count(close), e


def test_prometheus_config_scrapes_metrics():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = cfg["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]


def test_no_example_opens_metrics_to_anyone():
    """Issue 47: the Ray Serve and Kubernetes examples served /metrics (every key's usage) without a key. No
    manifest or config under deploy/ sets --metrics-public (comments may name it)."""
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert any(p.name == "ray-serve.yaml" for p in files) and any(p.parent.name == "k8s" for p in files)
    for path in files:
        content = json.dumps(list(yaml.safe_load_all(path.read_text())))
        assert "--metrics-public" not in content and "metrics_public" not in content, path
