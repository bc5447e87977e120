r"""Serving-time validation rules: the operator's constraints beyond the API's own, from a YAML or JSON file.

    rules:
      - name: short_prompts          # unique; becomes the `rule` label of lmserve:rule_violations_total
        field: prompt_tokens         # what the rule looks at (below)
        max: 2000                    # min / max: numbers (lists and strings: their length)
        policy: reject               # reject (400, the default) or log (count, record, let through)
      - name: known_models
        field: model                 # the model name the client sent
        allowed: [SmolLM2-135M-Instruct]
      - name: tag_requests
        field: user
        required: true
        policy: log
      - name: no_card_numbers
        field: prompt_text
        forbidden_pattern: '\b(?:\d[ -]?){13,16}\b'
        routes: [/v1/completions, /v1/chat/completions]   # optional scope
        message: card numbers are not accepted            # optional text for the 400

Fields: `prompt_tokens` (the longest prompt of the request), `total_prompt_tokens`, `num_prompts`,
`prompt_text` (prompts or message contents joined), `prompt_chars`, `messages` (the message count),
`model` (as sent), `route`, and any request parameter by name (`temperature`, `max_tokens`, `top_p`,
`n`, `stop`, `user`, `logprobs`, ...; TGI's `parameters` are flattened: `max_new_tokens`, ...).
A parameter the client left out is absent: only `required` looks at absent fields. A field that is
neither of these is an error at startup (a misspelt field would otherwise never match anything).
Rules run once the prompts are tokenized, before the request reaches the engine.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from prometheus_client import CollectorRegistry, Counter

from lmserve.ops.record import RequestRecord

POLICIES = ("reject", "log")
KINDS = ("min", "max", "allowed", "required", "pattern", "forbidden_pattern")
_MISSING = object()
DERIVED_FIELDS = frozenset({"prompt_tokens", "total_prompt_tokens", "num_prompts", "prompt_text", "prompt_chars",
                            "messages", "model", "route"})


class RuleViolation(ValueError):
    """A `reject` rule matched: the request is answered with 400 and this message."""

    def __init__(self, message: str, rule: str, param: str | None) -> None:
        super().__init__(message)
        self.rule, self.param = rule, param


@dataclass(frozen=True)
class Rule:
    name: str
    field: str
    policy: str = "reject"
    min: float | None = None
    max: float | None = None
    allowed: tuple[Any, ...] | None = None
    required: bool = False
    pattern: re.Pattern[str] | None = None
    forbidden_pattern: re.Pattern[str] | None = None
    routes: tuple[str, ...] | None = None
    message: str | None = None

    def violation(self, value: Any) -> str | None:
        """Why `value` breaks this rule (None when it does not). `_MISSING` means the field is absent."""
        if value is _MISSING or value is None:
            return f"{self.field} is required" if self.required else None
        size = len(value) if isinstance(value, (list, str, dict)) and self.field not in _TEXT_FIELDS else value
        if self.min is not None and _number(size) is not None and _number(size) < self.min:
            return f"{self.field} {_show(size)} is below the minimum {_show(self.min)}"
        if self.max is not None and _number(size) is not None and _number(size) > self.max:
            return f"{self.field} {_show(size)} is above the maximum {_show(self.max)}"
        if self.allowed is not None and value not in self.allowed:
            return f"{self.field} {_excerpt(value)} is not one of the allowed values"
        if self.pattern is not None and not (isinstance(value, str) and self.pattern.search(value)):
            return f"{self.field} does not match the required pattern"
        if self.forbidden_pattern is not None and isinstance(value, str) and self.forbidden_pattern.search(value):
            return f"{self.field} matches a forbidden pattern"
        return None


_TEXT_FIELDS = ("prompt_text",)  # patterns apply to the text; min/max on it mean characters (prompt_chars)


class RuleChecker:
    """Evaluates every rule on every request; counts violations; raises for the first `reject` one."""

    def __init__(self, rules: list[Rule], registry: CollectorRegistry | None = None) -> None:
        self.rules = rules
        self.violations = Counter("lmserve:rule_violations", "Requests that broke a validation rule",
                                  ["rule", "policy"], registry=registry or CollectorRegistry())
        for r in rules:  # rule names come from the file: a closed set, fixed at startup
            self.violations.labels(r.name, r.policy)

    @classmethod
    def load(cls, path: str | os.PathLike, params: Collection[str],
             registry: CollectorRegistry | None = None) -> "RuleChecker":
        """The rules of a file; `params`: the request parameters a rule may name (the server reads them from its
        body models: server/main.py rule_params)."""
        return cls(parse_rules(read_rules_file(Path(path)), str(path), params), registry)

    def check(self, record: RequestRecord, prompt_token_counts: list[int]) -> None:
        values = request_fields(record, prompt_token_counts)
        first_reject: RuleViolation | None = None
        for rule in self.rules:
            if rule.routes is not None and record.route not in rule.routes:
                continue
            why = rule.violation(values.get(rule.field, record.params.get(rule.field, _MISSING)))
            if why is None:
                continue
            self.violations.labels(rule.name, rule.policy).inc()
            record.rule_violations.append(rule.name)
            if rule.policy == "reject" and first_reject is None:
                param = rule.field if rule.field in record.params else None
                first_reject = RuleViolation(f"rule {rule.name!r}: {rule.message or why}", rule.name, param)
        if first_reject is not None:
            raise first_reject


def request_fields(record: RequestRecord, prompt_token_counts: list[int]) -> dict[str, Any]:
    """The derived fields rules can test (request parameters are looked up in record.params)."""
    text = record.prompt_text()
    fields: dict[str, Any] = {
        "prompt_tokens": max(prompt_token_counts, default=0), "total_prompt_tokens": sum(prompt_token_counts),
        "num_prompts": len(prompt_token_counts), "prompt_text": text, "prompt_chars": len(text),
        "route": record.route, "model": record.params.get("model", _MISSING),
    }
    if record.messages is not None:
        fields["messages"] = len(record.messages)
    return fields


# -- the file ------------------------------------------------------------------------------------


def read_rules_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"validation rules {path}: cannot read: {e.strerror}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml and json raise their own types
        raise ValueError(f"validation rules {path}: not valid {path.suffix.lstrip('.').upper() or 'JSON'}: "
                         f"{str(e).splitlines()[0][:200]}") from None


def parse_rules(doc: Any, source: str, params: Collection[str]) -> list[Rule]:
    """Rules from the parsed file, each naming a derived field or one of `params`; every problem names the rule
    (index and name) and the key."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise ValueError(f"validation rules {source}: expected a mapping with a 'rules' list")
    rules, names = [], set()
    for i, spec in enumerate(doc["rules"]):
        rule = _parse_rule(spec, f"validation rules {source}: rule #{i + 1}", params)
        if rule.name in names:
            raise ValueError(f"validation rules {source}: rule #{i + 1}: duplicate name {rule.name!r}")
        names.add(rule.name)
        rules.append(rule)
    return rules


def _parse_rule(spec: Any, where: str, params: Collection[str]) -> Rule:
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ValueError(f"{where}: 'name' must be 1-64 letters, digits, '_', '.' or '-'")
    where = f"{where} ({name})"
    unknown = set(spec) - {"name", "field", "policy", "routes", "message", *KINDS}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; rule kinds are {list(KINDS)}")
    field = spec.get("field")
    if not isinstance(field, str):
        raise ValueError(f"{where}: 'field' (a string) is required")
    if field not in DERIVED_FIELDS and field not in params:
        raise ValueError(f"{where}: unknown field {field!r}; fields are {sorted(DERIVED_FIELDS)} "
                         "or a request parameter (temperature, max_tokens, user, ...)")
    if not any(k in spec for k in KINDS):
        raise ValueError(f"{where}: give at least one of {list(KINDS)}")
    policy = spec.get("policy", "reject")
    if policy not in POLICIES:
        raise ValueError(f"{where}: 'policy' must be one of {list(POLICIES)}, got {policy!r}")
    for key in ("min", "max"):
        if key in spec and _number(spec[key]) is None:
            raise ValueError(f"{where}: {key!r} must be a number")
    if "min" in spec and "max" in spec and spec["min"] > spec["max"]:
        raise ValueError(f"{where}: 'min' {spec['min']} is above 'max' {spec['max']}: nothing could pass")
    if "message" in spec and not isinstance(spec["message"], str):
        raise ValueError(f"{where}: 'message' must be a string")
    if "allowed" in spec and not isinstance(spec["allowed"], list):
        raise ValueError(f"{where}: 'allowed' must be a list")
    if "required" in spec and not isinstance(spec["required"], bool):
        raise ValueError(f"{where}: 'required' must be true or false")
    routes = spec.get("routes")
    if routes is not None and not (isinstance(routes, list) and all(isinstance(r, str) for r in routes)):
        raise ValueError(f"{where}: 'routes' must be a list of paths")
    return Rule(name=name, field=field, policy=policy, min=spec.get("min"), max=spec.get("max"),
                allowed=tuple(spec["allowed"]) if "allowed" in spec else None,
                required=spec.get("required", False), pattern=_regex(spec, "pattern", where),
                forbidden_pattern=_regex(spec, "forbidden_pattern", where),
                routes=tuple(routes) if routes is not None else None, message=spec.get("message"))


def _regex(spec: dict, key: str, where: str) -> re.Pattern[str] | None:
    if key not in spec:
        return None
    try:
        return re.compile(spec[key])
    except (re.error, TypeError) as e:
        raise ValueError(f"{where}: {key!r} is not a valid regex: {e}") from None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _excerpt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
