"""Validation rules: file errors at startup, each rule kind, counting, and the real server's 400 / log-and-count."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lmserve.ops.record import RequestRecord
from lmserve.ops.rules import RuleChecker, RuleViolation, parse_rules
from lmserve.server import protocol
from lmserve.server.main import rule_params
from tests.server_util import MODEL, running_server

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "rules.example.yaml"


PARAMS = rule_params()  # what the server lets rules name


def checker(*rules: dict) -> RuleChecker:
    return RuleChecker(parse_rules({"rules": list(rules)}, "test", PARAMS), CollectorRegistry())


def rec(route="/v1/completions", prompt="hello", messages=None, **params) -> RequestRecord:
    return RequestRecord("r", route, params={"model": MODEL, **params}, prompt=prompt, messages=messages)


def test_example_file_loads():
    rules = RuleChecker.load(EXAMPLE, PARAMS).rules
    assert [r.name for r in rules][:2] == ["prompt_under_2k_tokens", "sane_temperature"]


@pytest.mark.parametrize("doc, match", [
    ("rules: [", "not valid YAML"),
    ("rules: 3", "'rules' list"),
    ("rules:\n  - {name: a, field: n, maximum: 3}", r"rule #1 \(a\): unknown key\(s\) \['maximum'\]"),
    ("rules:\n  - {name: a, field: user, pattern: '('}", "not a valid regex"),
    ("rules:\n  - {name: a, field: n, max: 3}\n  - {name: a, field: seed, max: 3}", "rule #2: duplicate name 'a'"),
    ("rules:\n  - {name: a, field: n, max: 3, policy: warn}", "'policy' must be one of"),
    ("rules:\n  - {name: a, field: n, max: lots}", "'max' must be a number"),
    ("rules:\n  - {name: a, field: n}", "give at least one of"),
    ("rules:\n  - {name: 'bad name!', field: n, max: 1}", "'name' must be"),
    ("rules:\n  - {name: ok, field: n, max: 1}\n  - {name: t, field: temprature, max: 1}",
     r"rule #2 \(t\): unknown field 'temprature'"),
    ("rules:\n  - {name: a, field: n, min: 3, max: 1}", "'min' 3 is above 'max' 1"),
    ("rules:\n  - {name: a, field: n, max: 1, message: [x]}", "'message' must be a string"),
])
def test_load_errors_name_the_rule_and_key(tmp_path, doc, match):
    path = tmp_path / "rules.yaml"
    path.write_text(doc)
    with pytest.raises(ValueError, match=match):
        RuleChecker.load(path, PARAMS)


def test_rules_may_name_every_request_parameter_but_the_prompt():
    """Every parameter a client can send can be named by a rule (OpenAI's, vLLM's extras, TGI's flattened
    `parameters`), and the prompt itself cannot (rules see it as the derived prompt_* fields)."""
    assert {"temperature", "cache_salt", "guided_json", "tools", "max_new_tokens", "adapter_id"} <= PARAMS
    assert set(protocol.ChatRequest.model_fields) - {"messages"} <= PARAMS
    assert not PARAMS & {"prompt", "messages", "inputs", "parameters"}


def test_json_file(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"rules": [{"name": "t", "field": "temperature", "max": 1}]}))
    c = RuleChecker.load(path, PARAMS)
    with pytest.raises(RuleViolation, match="rule 't': temperature 1.5 is above the maximum 1"):
        c.check(rec(temperature=1.5), [3])


def test_each_kind():
    c = checker({"name": "long", "field": "prompt_tokens", "max": 10},
                {"name": "temp", "field": "temperature", "min": 0.1, "max": 1.0},
                {"name": "model", "field": "model", "allowed": [MODEL]},
                {"name": "user", "field": "user", "required": True},
                {"name": "fmt", "field": "user", "pattern": "^u-[0-9]+$"},
                {"name": "card", "field": "prompt_text", "forbidden_pattern": r"\b(?:\d[ -]?){13,16}\b"},
                {"name": "stops", "field": "stop", "max": 2},
                {"name": "chat_only", "field": "messages", "max": 3, "routes": ["/v1/chat/completions"]})
    c.check(rec(temperature=0.5, user="u-1", stop=["a"]), [5])  # passes every rule

    def broken(record: RequestRecord, counts=(5,)) -> list[str]:
        with pytest.raises(RuleViolation):
            c.check(record, list(counts))
        return record.rule_violations

    assert broken(rec(user="u-1"), (11,)) == ["long"]
    assert broken(rec(user="u-1", temperature=0.0)) == ["temp"]
    assert broken(rec(user="u-1", model="other")) == ["model"]
    assert broken(rec()) == ["user"]  # an absent field only trips `required`
    assert broken(rec(user="bob")) == ["fmt"]
    assert broken(rec(user="u-1", prompt="pay with 4111 1111 1111 1111")) == ["card"]
    assert broken(rec(user="u-1", stop=["a", "b", "c"])) == ["stops"]  # lists: their length
    many = [{"role": "user", "content": "x"}] * 4
    c.check(rec(user="u-1", messages=many), [5])  # scoped to chat: not checked here
    assert broken(rec("/v1/chat/completions", user="u-1", messages=many)) == ["chat_only"]
    assert broken(rec(user="bob", temperature=2), (99,)) == ["long", "temp", "fmt"]  # every rule is counted


def test_log_policy_counts_and_lets_through():
    registry = CollectorRegistry()
    c = RuleChecker(parse_rules({"rules": [
        {"name": "tagged", "field": "user", "required": True, "policy": "log"},
        {"name": "short", "field": "prompt_chars", "max": 3, "message": "keep it short"}]}, "test", PARAMS), registry)
    r = rec(prompt="hi")
    c.check(r, [1])
    assert r.rule_violations == ["tagged"]
    with pytest.raises(RuleViolation, match="rule 'short': keep it short"):
        c.check(rec(prompt="hello"), [1])
    text = generate_latest(registry).decode()
    assert 'lmserve:rule_violations_total{policy="log",rule="tagged"} 2.0' in text
    assert 'lmserve:rule_violations_total{policy="reject",rule="short"} 1.0' in text


def test_server_rejects_and_counts(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("""rules:
  - {name: max_tokens_cap, field: max_tokens, max: 8}
  - {name: tagged, field: user, required: true, policy: log}
  - {name: no_secret, field: prompt_text, forbidden_pattern: 'TOP SECRET', message: classified text}
""")
    with running_server("--validation-rules", str(path)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=100)
        err = e.value.body
        assert err["code"] == "rule_violation" and err["param"] == "max_tokens"
        assert "max_tokens_cap" in err["message"] and "above the maximum 8" in err["message"]
        with pytest.raises(openai.BadRequestError, match="classified text"):
            c.chat.completions.create(model=MODEL, max_tokens=2, user="u",
                                      messages=[{"role": "user", "content": "the TOP SECRET plan"}])
        r = httpx.post(s.url + "/generate", json={"inputs": "TOP SECRET", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 422 and "classified text" in r.json()["error"]  # TGI's shape
        for i in range(3):  # untagged: logged and counted, served
            out = c.completions.create(model=MODEL, prompt=f"n{i}", max_tokens=2)
            assert out.choices[0].finish_reason in ("length", "stop")
        c.completions.create(model=MODEL, prompt="tagged", max_tokens=2, user="me")
        # untagged: the 3 served, the first 400 and the TGI request (every rule is evaluated on every request)
        assert s.metric("lmserve:rule_violations_total", 'policy="log",rule="tagged"') == 3 + 1 + 1
        assert s.metric("lmserve:rule_violations_total", 'policy="reject",rule="max_tokens_cap"') == 1
        assert s.metric("lmserve:rule_violations_total", 'policy="reject",rule="no_secret"') == 2
        assert s.metric("lmserve:requests_rejected_total", 'reason="validation_rule"') == 3
        s.wait_idle()


def test_bad_rules_file_stops_startup(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - {name: a, field: x, maxx: 1}\n")
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--validation-rules", str(path), "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown key(s) ['maxx']" in p.stderr and "Traceback" not in p.stderr
